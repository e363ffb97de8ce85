/* The capture hot path in C: see torchlens/capture/accel.py for how it is loaded. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Bumped whenever the records built here change shape, with torchlens.capture.accel.ABI. */
#define TORCHLENS_ACCEL_ABI 1

static struct PyModuleDef capture_module = {
    PyModuleDef_HEAD_INIT, "_capture", "torchlens's capture hot path, compiled.", -1, NULL,
};

PyMODINIT_FUNC PyInit__capture(void) {
    PyObject *m = PyModule_Create(&capture_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
