"""torchlens-accel: compiled versions of torchlens's capture hot path.

torchlens uses these modules when they are installed and their ``ABI`` matches its own
(``torchlens.capture.accel``); they record exactly what the pure-Python path records.  ``_autograd`` and
``_reads`` are built against torch's headers (only where torch is importable at build time) and are used
only with the torch they were built for.
"""
