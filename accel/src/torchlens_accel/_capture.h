/* What the two files of the ``_capture`` module share: ``_capture.c`` (the op handler, and the module's
 * init) and ``_module_calls.c`` (the module-call recorder). */
#ifndef TORCHLENS_ACCEL_CAPTURE_H
#define TORCHLENS_ACCEL_CAPTURE_H

#include <Python.h>

#include "fast_reads.h"

PyObject *now_ns(void);          /* time.perf_counter_ns().  New reference. */
extern PyObject *empty_tuple;    /* () */
extern PyObject *s_is_compiling; /* "_is_compiling_flag", interned */

/* Unwraps torchlens-accel's ``_reads`` capsule into ``*out``: NULL for None (the getters read instead).
 * 0, or -1 with a TypeError naming ``who`` when the capsule is from another build. */
int fast_reads_of(PyObject *capsule, const char *who, const FastReads **out);

/* Adds ``ModuleRecorder`` to the module.  0, or -1 with an exception set. */
int add_module_recorder(PyObject *module);

#endif
