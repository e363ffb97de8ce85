"""The compiled modules of torchlens-accel: plain C against the CPython API (no torch headers)."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("torchlens_accel._capture", ["src/torchlens_accel/_capture.c"], extra_compile_args=["-O2"]),
    Extension("torchlens_accel._grads", ["src/torchlens_accel/_grads.c"], extra_compile_args=["-O2"]),
    Extension("torchlens_accel._index", ["src/torchlens_accel/_index.c"], extra_compile_args=["-O2"]),
])
