"""torchlens-accel: compiled versions of torchlens's capture hot path.

torchlens uses these modules when they are installed and their ``ABI`` matches its own
(``torchlens.capture.accel``); they record exactly what the pure-Python path records.
"""
