"""The compiled modules of torchlens-accel.

``_capture``, ``_dispatch``, ``_grads`` and ``_index`` are plain C against the CPython API.  ``_autograd`` (gradient hooks as
autograd's own C++ hooks) and ``_reads`` (reads of torch state that its Python bindings make slowly) are built
against torch's headers, so only where torch is importable when building (``pip install
--no-build-isolation ./accel``); each records the torch it was built for, and torchlens uses it only with
that torch.  Without them, gradient capture takes the ``_grads`` hooks and those reads go through torch's
own bindings.
"""

from setuptools import Extension, setup

# An explicit C standard: torch's build command would otherwise give every module its C++ one.
C_FLAGS = ["-O2", "-std=c11"]
# name -> its C files (the op handler and the module-call recorder are one module, ``_capture``, in two files)
SOURCES = {"_capture": ["_capture.c", "_module_calls.c"], "_dispatch": ["_dispatch.c"], "_grads": ["_grads.c"],
           "_index": ["_index.c"]}
modules = [Extension(f"torchlens_accel.{name}", [f"src/torchlens_accel/{file}" for file in files],
                     extra_compile_args=C_FLAGS)
           for name, files in SOURCES.items()]
commands = {}
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # an isolated build, or no torch: the C++ hooks are left out
    pass
else:
    built_for = ["-O2", f'-DTORCHLENS_TORCH_VERSION="{torch.__version__}"']
    # optional: they use torch's C++ internals, which change between releases; against a torch where they do
    # not compile, the build says so and leaves them out (torchlens then reads through torch's bindings).
    modules += [CppExtension(f"torchlens_accel.{name}", [f"src/torchlens_accel/{name}.cpp"], extra_compile_args=built_for,
                             optional=True)
                for name in ("_autograd", "_reads")]
    commands["build_ext"] = BuildExtension.with_options(use_ninja=False)

setup(ext_modules=modules, cmdclass=commands)
