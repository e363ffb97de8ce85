/* The capture hot path in C: see torchlens/capture/accel.py for how it is loaded.
 *
 * ``Handler`` replaces ``CaptureMode.__torch_function__`` for a plain capture (every optional feature
 * off: see ``CaptureMode.plain``; an intervention's label sites hand it their own calls' positions, which
 * it passes to the Python method).  It records exactly what the Python method records, for the
 * commonest shapes of call: exact tensors and Parameters, plain values, and flat lists and tuples of
 * those (``torch.cat([a, b])``) in positional and keyword slots; one tensor out, or tuples (structseqs
 * included) and lists of tensors, None and plain values, nested.  Every other call is decided before
 * ``func`` runs and handed whole to the Python method; after the call, everything uncommon (other
 * results, writes found, sites other than a user frame or a torch module's forward, buffers that need
 * grad) goes through the same Python helpers the method calls.  Everything it needs from torch and torchlens is
 * handed over by Python at construction (``torchlens.capture.mode._compiled_handler``): this file
 * imports nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX < 0x030B0000
#error "torchlens-accel needs CPython 3.11 or newer (it reads frames through PyFrame_GetLasti); torchlens itself needs 3.11 too"
#endif
#include "_capture.h"
#include <structmember.h>
#include <time.h>

/* Bumped whenever the records built here change shape or what a plain capture asks of the handler changes (finite
 * flags, ABI 20; an intervention's action running, which the module recorder leaves unrecorded, ABI 21; the calls
 * of a thread other than the tracing one, handed to the Python method, ABI 22; the module recorder's calls of
 * another thread, noted by note_other_thread, ABI 23), with torchlens.capture.accel.ABI. */
#define TORCHLENS_ACCEL_ABI 23

/* The tensor arguments one call's scan holds on the stack; a call with more (torch.cat of many) allocates. */
#define MAX_TENSORS 16

/* The code objects whose frame verdicts a handler remembers, and the sites it made (powers of two). */
#define VERDICTS_SEEN 64
#define SITES_SEEN 64

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *mode_ref;       /* weak reference to the CaptureMode (no cycle through its __dict__) */
    PyObject *method;         /* CaptureMode.__torch_function__, the Python method, unbound */
    PyObject *state;          /* the CaptureState */
    PyObject *state_dict;     /* its __dict__: the raw lists and flags, read per call */
    PyObject *off_hot_path;   /* frozenset: calls that are not ops, and x.data (the Python method's) */
    PyObject *not_ops;        /* frozenset: calls that never produce a tensor, run unrecorded */
    PyObject *numpy_views;    /* frozenset: not ops that the Python method still looks at */
    PyObject *compiler_dict;  /* torch.compiler's namespace (its _is_compiling_flag) */
    PyObject *tensor_type;
    PyObject *parameter_type;
    PyObject *function_type;
    PyObject *plain_values;   /* frozenset of the exact types held by value */
    PyObject *tuple_values;   /* frozenset of the exact types a flat tuple may hold and stay as it is */
    PyObject *inplace_cache;  /* func -> in-place verdict */
    PyObject *running_stats;  /* func -> (flag name, flag position): a norm whose kernel writes its running statistics */
    PyObject *buffer_kind;    /* a buffer source's record kind (record.columns.BUFFER) */
    PyObject *no_kwargs;      /* the shared empty keyword dict */
    PyObject *protect;        /* _protect_before_write(st, func, args, kwargs) */
    PyObject *output_leaves;  /* _output_leaves(func, out, args, kwargs) */
    PyObject *record_output;  /* _record_output(st, call_index, slot, t, func, module_call) */
    PyObject *written_arguments; /* _written_arguments(func, args, kwargs, versions, out) */
    PyObject *shape_of;
    PyObject *verdicts;       /* id(code) -> verdict */
    PyObject *locate;         /* FrameClassifier.locate, bound */
    PyObject *dispatched_site;
    PyObject *call_impl;      /* nn.Module._call_impl.__code__ */
    PyObject *call_impl_inner;
    PyObject *grad_enabled;   /* torch.is_grad_enabled */
    PyObject *any_autocast;   /* torch._C._is_any_autocast_enabled */
    PyObject *getters;        /* the tensor attributes' data descriptors, in GETTER order, or None */
    const FastReads *fast;    /* torchlens-accel's _reads (fast_reads.h), or NULL: then the getters */
    long user, skip, dispatch, stop, boundary;  /* the frame verdicts (capture/source.py) */
    unsigned long thread;     /* the tracing thread, the only one whose calls are recorded (handler_vectorcall) */
    /* The state's raw lists and dicts, in HELD order: a CaptureState makes them in its constructor and
     * keeps them for the whole trace, so they are looked up once, when the handler is bound, instead of
     * in the state's __dict__ several times per op.  NULL where the state had none (then looked up per
     * use, which raises as the Python method would). */
    PyObject *held[7];
    /* The verdicts already read in this trace, by code object (direct-mapped; see ``verdict_of``). */
    struct { PyObject *code; long verdict; } seen[VERDICTS_SEEN];
    /* The (code, offset) site tuples already made in this trace, direct-mapped (see ``site_at``); each
     * holds its code, so no code's address is reused while it is here. */
    struct { PyObject *code; int lasti; PyObject *site; } sites[SITES_SEEN];
} Handler;

enum { H_CALLS, H_RECORDS, H_PRODUCERS, H_SAVED, H_SAVED_VERSIONS, H_MODULE_STACK, H_CALL_FRAMES, N_HELD };
static PyObject *held_names[N_HELD];

/* The tensor attributes read per op, read through their descriptors on exact tensors and Parameters
 * (which resolve them to the same data descriptors; checked at construction). */
enum { G_VERSION, G_SHAPE, G_DTYPE, G_DEVICE, G_REQUIRES_GRAD, G_GRAD_FN, N_GETTERS };
static PyObject *getter_names[N_GETTERS];

/* Interned names. */
static PyObject *s_version, *s_shape, *s_dtype, *s_device, *s_requires_grad, *s_grad_fn, *s_detach,
    *s_producers, *s_calls, *s_records, *s_saved, *s_saved_versions, *s_module_stack, *s_call_frames,
    *s_save_mode, *s_grad_enabled, *s_any_autocast, *s_grads, *s_producer_of, *s_version_m,
    *s_note_failure, *s_note_context, *s_note_writes, *s_note_pass_through, *s_note_returned_arguments,
    *s_wants, *s_watch, *s_out,
    *s_inplace, *s_torch_function, *s_save, *s_finite_flags, *s_record_finite, *s_plain_save, *s_buffers, *s_save_sources, *s_context, *s_contexts,
    *s_recent_alias_reads, *s_forget_unrecorded_reads, *s_site_calls, *s_intervention, *s_at_call;

PyObject *empty_tuple;
PyObject *s_is_compiling;

/* An exact torch.Tensor or Parameter (a subclass may answer its attributes itself). */
static int is_plain_tensor(Handler *h, PyObject *t) {
    PyTypeObject *type = Py_TYPE(t);
    return type == (PyTypeObject *)h->tensor_type || type == (PyTypeObject *)h->parameter_type;
}

static PyObject *tensor_get(Handler *h, PyObject *t, int which) {
    PyTypeObject *type = Py_TYPE(t);
    if (h->getters != Py_None && (type == (PyTypeObject *)h->tensor_type || type == (PyTypeObject *)h->parameter_type)) {
        PyObject *d = PyTuple_GET_ITEM(h->getters, which);
        return Py_TYPE(d)->tp_descr_get(d, t, (PyObject *)type);
    }
    return PyObject_GetAttr(t, getter_names[which]);
}

/* ``t._version``, off the TensorImpl where ``_reads`` is built, else by its getter.  New reference. */
static PyObject *read_version(Handler *h, PyObject *t) {
    if (h->fast != NULL && is_plain_tensor(h, t)) {
        PyObject *v = h->fast->version(t);
        if (v != NULL || PyErr_Occurred()) return v;
    }
    return tensor_get(h, t, G_VERSION);
}

/* A state attribute, borrowed; an AttributeError when missing. */
static PyObject *state_get(Handler *h, PyObject *name) {
    PyObject *v = PyDict_GetItemWithError(h->state_dict, name);
    if (v == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
    return v;
}

/* One of the state's raw containers (``H_CALLS``...), borrowed: as held since binding. */
static PyObject *held(Handler *h, int which) {
    PyObject *v = h->held[which];
    return v != NULL ? v : state_get(h, held_names[which]);
}

/* Holds the state's raw containers (see ``Handler.held``).  0 or -1. */
static int hold_containers(Handler *h) {
    for (int i = 0; i < N_HELD; i++) {
        PyObject *v = PyDict_GetItemWithError(h->state_dict, held_names[i]);
        if (v == NULL && PyErr_Occurred()) return -1;
        Py_XSETREF(h->held[i], Py_XNewRef(v));
    }
    return 0;
}

/* ``time.perf_counter_ns()``.  New reference. */
PyObject *now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* time.perf_counter_ns's clock on Linux */
    return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
}

int fast_reads_of(PyObject *capsule, const char *who, const FastReads **out) {
    *out = NULL;
    if (capsule == Py_None) return 0;
    const FastReads *fast = (const FastReads *)PyCapsule_GetPointer(capsule, TORCHLENS_FAST_READS_NAME);
    if (fast == NULL || fast->abi != TORCHLENS_FAST_READS_ABI) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s: fast_reads is from another build of torchlens-accel's _reads", who);
        return -1;
    }
    *out = fast;
    return 0;
}

/* A call that made no tensor is no op: the reads through an alias its argument scan noted
 * (``st.producer_of``) are no op's, and not the next recorded call's, which takes its call index:
 * ``st.forget_unrecorded_reads()`` when any were noted since a call last recorded nothing.  0 or -1. */
static int forget_unrecorded_reads(Handler *h) {
    PyObject *reads = state_get(h, s_recent_alias_reads);
    if (reads == NULL) return -1;
    if (PyObject_Size(reads) == 0) return 0;
    PyObject *r = PyObject_CallMethodNoArgs(h->state, s_forget_unrecorded_reads);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* ``t._version``, or ``st.version(t)`` (None, noting it) for an inference tensor.  New reference. */
static PyObject *version_of(Handler *h, PyObject *t) {
    PyObject *v = read_version(h, t);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        PyErr_Clear();
        v = PyObject_CallMethodOneArg(h->state, s_version_m, t);
    }
    return v;
}

/* ``st.producer_of(t)`` for a tensor no entry is about (defined with the records below). */
static PyObject *unbound_source(Handler *h, PyObject *t, PyObject *key);
/* ``st.record_finite(index, t)`` when the trace records finite flags (defined below). */
static int note_finite(Handler *h, PyObject *index, PyObject *t);

/* The record index of a tensor argument read at ``version``: ``st.producer_of(t)``, answered here when
 * its entry is about ``t`` at that version (the bound producer) or no entry is (``unbound_source``), by
 * Python otherwise (written since it was bound).  New reference. */
static PyObject *parent_of(Handler *h, PyObject *producers, PyObject *t, PyObject *version) {
    PyObject *key = PyLong_FromVoidPtr(t);
    if (key == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(producers, key), *index = NULL;
    int bound = 0, valid = entry != NULL && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 3;
    if (valid) {
        PyObject *ref = PyTuple_GET_ITEM(entry, 0);
        bound = ref == t || (PyWeakref_CheckRefExact(ref) && PyWeakref_GetObject(ref) == t);  /* ``is_bound`` */
        /* An inference tensor has no version (None): Python checks the writes noted on its storage. */
        int same = bound && version != Py_None
            ? PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 2), version, Py_EQ) : 0;
        if (same > 0) index = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
    } else if (entry == NULL && !PyErr_Occurred()) {
        index = unbound_source(h, t, key);
    }
    if (valid && !bound) index = unbound_source(h, t, key);  /* about a dead tensor whose id ``t`` reuses */
    Py_DECREF(key);
    if (index != NULL || PyErr_Occurred()) return index;
    return PyObject_CallMethodOneArg(h->state, s_producer_of, t);
}

enum { KIND_PLAIN = 0, KIND_TENSOR = 1, KIND_PARAM = 2, KIND_OTHER = 3, KIND_CONTAINER = 4 };

static int is_tensor(Handler *h, PyObject *a) {
    return Py_TYPE(a) == (PyTypeObject *)h->tensor_type || Py_TYPE(a) == (PyTypeObject *)h->parameter_type;
}

/* How an argument is recorded: a tensor, a Parameter, a value held as it is, a flat container of those
 * (``torch.cat([a, b])``, ``torch.stack((a, b))``, ``x.permute([0, 2, 1])``), or other (Python).  A
 * container's tensors and Parameters are added to ``*tensors`` and ``*params``. */
static int kind_of(Handler *h, PyObject *a, int *tensors, int *params) {
    PyObject *type = (PyObject *)Py_TYPE(a);
    if (type == h->tensor_type) return KIND_TENSOR;
    if (type == h->parameter_type) return KIND_PARAM;
    int found = PySet_Contains(h->plain_values, type);
    if (found < 0) return -1;
    if (found) return KIND_PLAIN;
    int is_list = PyList_CheckExact(a);
    if (!is_list && !PyTuple_CheckExact(a)) return KIND_OTHER;
    /* ``tree.split``'s flat case: tensors and plain values.  A list is always copied into the record (the
     * model may change it later), a tuple only when it holds tensors: one without (normalized_shape,
     * kernel sizes, x[..., 0:2]) is held as it is. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    int count = 0, found_params = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(a, i);
        if (is_tensor(h, item)) {
            count++;
            found_params += Py_TYPE(item) == (PyTypeObject *)h->parameter_type;
            continue;
        }
        found = PySet_Contains(h->tuple_values, (PyObject *)Py_TYPE(item));
        if (found <= 0) return found < 0 ? -1 : KIND_OTHER;
    }
    if (!is_list && count == 0) return KIND_PLAIN;
    *tensors += count;
    *params += found_params;
    return KIND_CONTAINER;
}

/* One scanned tensor argument: the tensor and its version before the call. */
typedef struct {
    PyObject *t;        /* owned: a list argument the call empties must not free it before the checks */
    PyObject *version;  /* owned */
} Bound;

static void release_bounds(Bound *bounds, int n) {
    for (int i = 0; i < n; i++) {
        Py_DECREF(bounds[i].t);
        Py_XDECREF(bounds[i].version);
    }
}

/* ``versions`` as the Python helpers take it: a list of (tensor, version) pairs.  New reference. */
static PyObject *versions_list(Bound *bounds, int n) {
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        PyObject *pair = PyTuple_Pack(2, bounds[i].t, bounds[i].version);
        if (pair == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, pair);
    }
    return list;
}

/* The Python method, called as torch called this handler. */
static PyObject *call_method(Handler *h, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *mode = PyWeakref_GetObject(h->mode_ref);
    if (mode == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "torchlens: the capture mode this handler belongs to is gone");
        return NULL;
    }
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[8];
    PyObject **stack = total + 1 <= 8 ? small : PyMem_Malloc((total + 1) * sizeof(PyObject *));
    if (stack == NULL) return PyErr_NoMemory();
    stack[0] = mode;
    for (Py_ssize_t i = 0; i < total; i++) stack[i + 1] = args[i];
    Py_INCREF(mode);
    PyObject *result = PyObject_Vectorcall(h->method, stack, nargs + 1, kwnames);
    Py_DECREF(mode);
    if (stack != small) PyMem_Free(stack);
    return result;
}

/* Whether ``frame`` is torch's module call machinery calling ``forward`` (_called_by_module_call). */
static int called_by_module_call(Handler *h, PyFrameObject *frame) {
    if (frame == NULL) return 0;
    PyCodeObject *code = PyFrame_GetCode(frame);
    int answer;
    if ((PyObject *)code == h->call_impl_inner) {
        PyFrameObject *back = PyFrame_GetBack(frame);
        if (back == NULL) {
            answer = 0;
        } else {
            PyCodeObject *outer = PyFrame_GetCode(back);
            answer = (PyObject *)outer == h->call_impl;
            Py_DECREF(outer);
            Py_DECREF(back);
        }
    } else {
        answer = (PyObject *)code == h->call_impl;
    }
    Py_DECREF(code);
    return answer;
}

/* ``verdicts.get(id(code))``: -1 when unknown, -2 on error.  A known verdict never changes within a trace
 * (the classifier holds every code it classifies while any trace runs and forgets a verdict only as its code
 * dies, so no id is reused meanwhile, and sets its stop codes when torchlens is imported), so the handler
 * remembers those it read in its trace: most ops come from a few lines. */
static long verdict_of(Handler *h, PyObject *code) {
    size_t slot = ((uintptr_t)code >> 4) & (VERDICTS_SEEN - 1);
    if (h->seen[slot].code == code) return h->seen[slot].verdict;
    PyObject *key = PyLong_FromVoidPtr(code);
    if (key == NULL) return -2;
    PyObject *v = PyDict_GetItemWithError(h->verdicts, key);
    Py_DECREF(key);
    if (v == NULL) return PyErr_Occurred() ? -2 : -1;
    long verdict = PyLong_AsLong(v);
    if (verdict == -1 && PyErr_Occurred()) return -2;
    h->seen[slot].code = code;
    h->seen[slot].verdict = verdict;
    return verdict;
}

/* ``call_frames[module_call]`` as a (code, offset) tuple.  New reference. */
static PyObject *module_call_frame(Handler *h, PyObject *module_call) {
    PyObject *call_frames = held(h, H_CALL_FRAMES);
    PyObject *user = call_frames ? PyObject_GetItem(call_frames, module_call) : NULL;
    PyObject *pair = user ? PySequence_Tuple(user) : NULL;
    Py_XDECREF(user);
    if (pair != NULL && PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_ValueError, "torchlens: a module call frame is not a (code, offset) pair");
        Py_CLEAR(pair);
    }
    return pair;
}

/* The three answers, each a new reference (``site`` stolen). */
static int answer(PyObject *site, PyObject *code, PyObject *line, PyObject **out) {
    if (site == NULL) return -1;
    out[0] = site;
    out[1] = Py_NewRef(code);
    out[2] = Py_NewRef(line);
    return 1;
}

/* The site ``(code, lasti)``, a new reference: within a trace the same tuple for the same site (most ops
 * come from a few lines, and each record holds its site and its line, which need not be new objects). */
static PyObject *site_at(Handler *h, PyObject *code, int lasti) {
    size_t slot = (((uintptr_t)code >> 4) ^ ((size_t)lasti * 0x9E3779B1u)) & (SITES_SEEN - 1);
    if (h->sites[slot].site != NULL && h->sites[slot].code == code && h->sites[slot].lasti == lasti)
        return Py_NewRef(h->sites[slot].site);
    PyObject *line = PyLong_FromLong(lasti);
    if (line == NULL) return NULL;
    PyObject *site = PyTuple_Pack(2, code, line);
    Py_DECREF(line);
    if (site == NULL) return NULL;
    Py_XSETREF(h->sites[slot].site, Py_NewRef(site));
    h->sites[slot].code = code;
    h->sites[slot].lasti = lasti;
    return site;
}

static PyObject *site_of(Handler *h, PyObject *code, PyFrameObject *frame) {
    return site_at(h, code, PyFrame_GetLasti(frame));
}

/* ``capture/source.py``'s ``user_site``: the site of the user frame ``frame`` running ``code``, followed by
 * the site of the user line that called its function (a helper called from two lines is two sites), found
 * through torch's own frames and ``code``'s own (a recursion), up to a module call, the trace or torchlens.
 * A new reference; NULL with ``*unknown`` set at a frame without a verdict yet (Python's walk classifies
 * it), NULL with an exception set on error. */
static PyObject *user_site(Handler *h, PyObject *code, PyFrameObject *frame, int *unknown) {
    PyObject *site = site_of(h, code, frame);
    if (site == NULL) return NULL;
    PyFrameObject *back = PyFrame_GetBack(frame);
    while (back != NULL) {
        PyObject *caller = (PyObject *)PyFrame_GetCode(back);
        long verdict = caller == code ? h->skip : verdict_of(h, caller);
        if (verdict == h->user) {
            PyObject *outer = user_site(h, caller, back, unknown);
            PyObject *nested = outer != NULL
                ? PyTuple_Pack(3, PyTuple_GET_ITEM(site, 0), PyTuple_GET_ITEM(site, 1), outer) : NULL;
            Py_XDECREF(outer);
            Py_SETREF(site, nested);
            Py_DECREF(caller);
            break;
        }
        Py_DECREF(caller);
        if (verdict == -1 || verdict == -2) {
            *unknown = verdict == -1;
            Py_CLEAR(site);
            break;
        }
        if (verdict != h->skip) break;
        PyFrameObject *next = PyFrame_GetBack(back);
        Py_DECREF(back);
        back = next;
    }
    Py_XDECREF(back);
    return site;
}

/* ``answer`` for the user frame ``frame`` running ``code``: its site (``user_site``), and its code and
 * line; 0 when a caller has no verdict yet. */
static int user_answer(Handler *h, PyObject *code, PyFrameObject *frame, PyObject **out) {
    int unknown = 0;
    PyObject *site = user_site(h, code, frame, &unknown);
    if (site == NULL) return unknown ? 0 : -1;
    return answer(site, code, PyTuple_GET_ITEM(site, 1), out);
}

/* ``FrameClassifier.locate``'s walk up from ``frame``, for frames whose verdicts are known: 1 with
 * ``out`` = (site, code, line), 0 at a frame without a verdict yet (Python's walk classifies it), -1 on
 * error.  ``own_code`` is the code of the Python-level torch function being recorded, or NULL. */
static int walk(Handler *h, PyFrameObject *frame, PyObject *own_code, PyObject *module_call, long module_index,
                PyObject **out) {
    PyObject *site = NULL;
    int result = -1;
    Py_XINCREF(frame);
    while (frame != NULL) {
        PyObject *code = (PyObject *)PyFrame_GetCode(frame);
        long verdict = verdict_of(h, code);
        if (verdict == -2 || verdict == -1) {
            result = verdict == -1 ? 0 : -1;
            Py_DECREF(code);
            goto done;
        }
        if (verdict == h->user) {
            if (site == NULL) {
                result = user_answer(h, code, frame, out);
            } else {  /* torch's line, with the user lines that reached it */
                int unknown = 0;
                PyObject *reached = user_site(h, code, frame, &unknown);
                if (reached == NULL) {
                    result = unknown ? 0 : -1;
                } else {
                    PyObject *nested = PyTuple_Pack(3, PyTuple_GET_ITEM(site, 0), PyTuple_GET_ITEM(site, 1), reached);
                    result = nested != NULL ? answer(nested, code, PyTuple_GET_ITEM(reached, 1), out) : -1;
                    Py_DECREF(reached);
                }
            }
            Py_DECREF(code);
            goto done;
        }
        if (verdict == h->stop) {
            Py_DECREF(code);
            result = answer(Py_NewRef(site != NULL ? site : Py_None), Py_None, Py_None, out);
            goto done;
        }
        if (verdict == h->boundary && module_index >= 0) {
            Py_DECREF(code);
            PyObject *user = module_call_frame(h, module_call);
            if (user == NULL) goto done;
            PyObject *user_code = PyTuple_GET_ITEM(user, 0);
            PyObject *found = site != NULL ? site : user_code != Py_None ? user : Py_None;
            result = answer(Py_NewRef(found), user_code, PyTuple_GET_ITEM(user, 1), out);
            Py_DECREF(user);
            goto done;
        }
        if (verdict == h->skip && site == NULL && code != own_code && (site = site_of(h, code, frame)) == NULL) {
            Py_DECREF(code);
            goto done;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    result = answer(Py_NewRef(site != NULL ? site : Py_None), Py_None, Py_None, out);
done:
    Py_XDECREF(frame);
    Py_XDECREF(site);
    return result;
}

/* ``getattr(func, "__code__", None)`` for the kinds of function torch hands over; 0 for any other kind
 * (the Python walk answers for those).  ``*code`` is borrowed, NULL for None. */
static int own_code_of(PyObject *func, PyObject **code) {
    if (PyFunction_Check(func)) {
        *code = PyFunction_GET_CODE(func);
        return 1;
    }
    *code = NULL;
    return PyCFunction_Check(func) || Py_IS_TYPE(func, &PyMethodDescr_Type) || Py_IS_TYPE(func, &PyWrapperDescr_Type);
}

/* ``dispatched_site`` (capture/source.py): a call that torch's dispatcher (``frame``, in torch/overrides.py)
 * handed over.  For a Python-level torch function whose own frame is next, the answer is its caller's.  Same
 * returns as ``walk``. */
static int dispatched(Handler *h, PyFrameObject *frame, PyObject *own_code, PyObject *module_call, long module_index,
                      PyObject **out) {
    PyFrameObject *own = PyFrame_GetBack(frame);
    if (own == NULL) return walk(h, frame, own_code, module_call, module_index, out);
    PyObject *code = (PyObject *)PyFrame_GetCode(own);
    long verdict = code == own_code ? verdict_of(h, code) : -3;
    Py_DECREF(code);
    if (verdict == -2 || verdict != h->skip) {
        Py_DECREF(own);
        return verdict == -2 ? -1 : walk(h, frame, own_code, module_call, module_index, out);
    }
    PyFrameObject *caller = PyFrame_GetBack(own);
    Py_DECREF(own);
    if (caller == NULL) return walk(h, NULL, own_code, module_call, module_index, out);
    int result;
    code = (PyObject *)PyFrame_GetCode(caller);
    verdict = verdict_of(h, code);
    if (verdict == -2) {
        result = -1;
    } else if (verdict == h->user) {
        result = user_answer(h, code, caller, out);
    } else {
        PyFrameObject *back = verdict == h->skip && module_index >= 0 ? PyFrame_GetBack(caller) : NULL;
        int by_call = back != NULL && called_by_module_call(h, back);
        Py_XDECREF(back);
        if (by_call) {
            PyObject *user = module_call_frame(h, module_call);
            result = user ? answer(site_of(h, code, caller), PyTuple_GET_ITEM(user, 0), PyTuple_GET_ITEM(user, 1), out) : -1;
            Py_XDECREF(user);
        } else {
            result = walk(h, caller, own_code, module_call, module_index, out);
        }
    }
    Py_DECREF(code);
    Py_DECREF(caller);
    return result;
}

/* ``(site, code, line)`` of the op, as the Python method finds them.  New references in the out
 * arguments; -1 with an exception set on failure. */
static int find_site(Handler *h, PyObject *func, PyObject *module_call, long module_index,
                     PyObject **site, PyObject **code_out, PyObject **line_out) {
    PyFrameObject *frame = PyEval_GetFrame();  /* borrowed: the frame that called the torch function */
    PyObject *found[3];
    PyObject *code = frame != NULL ? (PyObject *)PyFrame_GetCode(frame) : NULL;
    long verdict = code != NULL ? verdict_of(h, code) : -1;
    if (verdict == -2) {
        Py_DECREF(code);
        return -1;
    }
    int known = 0;
    if (verdict == h->user) {
        known = user_answer(h, code, frame, found);
    } else if (verdict == h->skip && module_index >= 0 && Py_TYPE(func) != (PyTypeObject *)h->function_type) {
        /* A builtin called straight from a torch module's forward (F.linear in nn.Linear). */
        PyFrameObject *back = PyFrame_GetBack(frame);
        int by_call = called_by_module_call(h, back);
        Py_XDECREF(back);
        if (by_call) {
            PyObject *user = module_call_frame(h, module_call);
            known = user ? answer(site_of(h, code, frame), PyTuple_GET_ITEM(user, 0), PyTuple_GET_ITEM(user, 1), found) : -1;
            Py_XDECREF(user);
        }
    }
    if (known == 0 && frame != NULL) {
        /* A Python-level torch function (F.relu), torch's own code elsewhere: the walk, in C while every
         * frame on it has a verdict already. */
        PyObject *own_code;
        if (own_code_of(func, &own_code)) {
            known = verdict == h->dispatch ? dispatched(h, frame, own_code, module_call, module_index, found)
                                           : walk(h, frame, own_code, module_call, module_index, found);
        }
    }
    Py_XDECREF(code);
    if (known < 0) return -1;
    if (known) {
        *site = found[0];
        *code_out = found[1];
        *line_out = found[2];
        return 0;
    }
    /* A new frame (classified by the Python walk), or a kind of function the C does not know. */
    PyObject *call_frames = held(h, H_CALL_FRAMES);
    if (call_frames == NULL) return -1;
    PyObject *frame_obj = frame != NULL ? (PyObject *)frame : Py_None;
    PyObject *result;
    if (verdict == h->dispatch) {
        PyObject *argv[] = {frame_obj, func, call_frames, module_call, h->locate};
        result = PyObject_Vectorcall(h->dispatched_site, argv, 5, NULL);
    } else {
        PyObject *argv[] = {frame_obj, func, call_frames, module_call};
        result = PyObject_Vectorcall(h->locate, argv, 4, NULL);
    }
    if (result == NULL) return -1;
    PyObject *triple = PySequence_Tuple(result);
    Py_DECREF(result);
    if (triple == NULL) return -1;
    if (PyTuple_GET_SIZE(triple) != 3) {
        PyErr_SetString(PyExc_ValueError, "torchlens: locate did not answer (site, code, line)");
        Py_DECREF(triple);
        return -1;
    }
    *site = Py_NewRef(PyTuple_GET_ITEM(triple, 0));
    *code_out = Py_NewRef(PyTuple_GET_ITEM(triple, 1));
    *line_out = Py_NewRef(PyTuple_GET_ITEM(triple, 2));
    Py_DECREF(triple);
    return 0;
}

/* A Python truth value of a state flag or call result (stolen), -1 on error. */
static int truth_of(PyObject *v) {
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The record of the one tensor a call produced, inlined as in the Python method.  0 or -1. */
/* Appends the tensor record of ``out`` (at ``slot`` of the call's result) to ``records``; ``*rg`` is
 * whether it requires grad.  0 or -1. */
/* ``*node_out`` gets the output's grad_fn (a new reference, or NULL when it needs no grad): the caller keeps
 * it until the gradient watch has read it again, so that torch makes one node object per op, not two.
 * ``*rg_out`` is RG_REFUSED for a tensor that requires grad but whose node torch refuses to give (a view
 * made under no_grad whose base was then written in place): recorded without a node, never watched, as
 * ``outputs.grad_node`` does. */
enum { RG_REFUSED = 2 };  /* ``*rg_out`` of append_record: requires grad, no node to watch */

static int append_record(Handler *h, PyObject *records, PyObject *out, PyObject *call_index, PyObject *slot,
                         int *rg_out, PyObject **node_out) {
    PyObject *requires_grad, *shape = NULL, *dtype = NULL, *device = NULL, *grad_fn = NULL;
    int rg = 0, read = h->fast != NULL && is_plain_tensor(h, out)
                           ? h->fast->facts(out, &shape, &dtype, &device, &rg, &grad_fn) : 1;
    if (read < 0) return -1;
    if (read == 0) {
        requires_grad = Py_NewRef(rg ? Py_True : Py_False);
    } else {
        if ((requires_grad = tensor_get(h, out, G_REQUIRES_GRAD)) == NULL) return -1;
        rg = PyObject_IsTrue(requires_grad);
        if (rg < 0) {
            Py_DECREF(requires_grad);
            return -1;
        }
        /* A subclass (a jagged nested tensor answers .shape with symbolic sizes) has its shape read by shape_of. */
        shape = is_plain_tensor(h, out) ? tensor_get(h, out, G_SHAPE) : PyObject_CallOneArg(h->shape_of, out);
        if (shape == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError)) {  /* a nested tensor */
            PyErr_Clear();
            shape = PyObject_CallOneArg(h->shape_of, out);
        }
        dtype = shape ? tensor_get(h, out, G_DTYPE) : NULL;
        device = dtype ? tensor_get(h, out, G_DEVICE) : NULL;
    }
    PyObject *grad_type = NULL;
    if (device != NULL) {
        if (rg) {
            if (grad_fn == NULL) grad_fn = tensor_get(h, out, G_GRAD_FN);  /* read by the getters above */
            if (grad_fn == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError)) {  /* the node is refused */
                PyErr_Clear();
                rg = RG_REFUSED;
                grad_type = Py_NewRef(Py_None);
            } else if (grad_fn != NULL) {
                grad_type = (PyObject *)Py_TYPE(grad_fn);
                Py_INCREF(grad_type);
                *node_out = grad_fn;
            }
        } else {
            grad_type = Py_None;
            Py_INCREF(grad_type);
        }
    }
    PyObject *record = grad_type ? PyTuple_Pack(7, call_index, slot, shape, dtype, device, requires_grad,
                                                grad_type) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    Py_XDECREF(grad_type);
    Py_DECREF(requires_grad);
    if (record == NULL) {
        Py_CLEAR(*node_out);
        return -1;
    }
    int failed = PyList_Append(records, record);
    Py_DECREF(record);
    *rg_out = rg;
    if (failed) Py_CLEAR(*node_out);
    return failed ? -1 : 0;
}

/* Whether the output of ``func`` is saved: 1 when ``save_mode == 1`` (every op, held until the trace ends), 2
 * when the selection wants it (it may be let go before then, dropped as written unseen), 0, or -1. */
static int wanted(Handler *h, PyObject *func, PyObject *module_call) {
    PyObject *save_mode = state_get(h, s_save_mode);
    if (save_mode == NULL) return -1;
    int saving = PyObject_IsTrue(save_mode);
    if (saving <= 0) return saving;
    long mode = PyLong_Check(save_mode) ? PyLong_AsLong(save_mode) : -1;
    if (mode == -1 && PyErr_Occurred()) return -1;
    if (mode == 1) return 1;
    PyObject *argv[] = {h->state, func, module_call};
    saving = truth_of(PyObject_VectorcallMethod(s_wants, argv, 3, NULL));
    return saving == 1 ? 2 : saving;
}

/* ``grads.watch(index, t, func, module_call)`` when gradients are captured.  0 or -1. */
static int watch(Handler *h, PyObject *index, PyObject *t, PyObject *func, PyObject *module_call) {
    PyObject *grads = state_get(h, s_grads);
    if (grads == NULL) return -1;
    if (grads == Py_None) return 0;
    PyObject *argv[] = {grads, index, t, func, module_call};
    PyObject *r = PyObject_VectorcallMethod(s_watch, argv, 5, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* ``st.save(index, t, rg)``'s common case, inlined: no device move and no budget (``plain_save``).  0
 * when saved here, 1 when ``st.save`` must save it, -1 on error.  ``version`` is ``t``'s, which its
 * detached alias shares; ``index`` is a new record, never below ``keyed_to``, so nothing is to re-key. */
static int save_inline(Handler *h, PyObject *index, PyObject *t, int rg, PyObject *version) {
    PyObject *plain = state_get(h, s_plain_save);
    if (plain == NULL) return -1;
    if (plain != Py_True) return 1;
    PyObject *saved = held(h, H_SAVED);
    PyObject *saved_versions = saved ? held(h, H_SAVED_VERSIONS) : NULL;
    PyObject *kept = saved_versions == NULL ? NULL : rg ? PyObject_CallMethodNoArgs(t, s_detach) : Py_NewRef(t);
    if (kept == NULL) return -1;
    int failed = PyDict_SetItem(saved, index, kept) || PyDict_SetItem(saved_versions, index, version);
    Py_DECREF(kept);
    return failed ? -1 : 0;
}

/* ``st.producer_of(t)`` for a tensor no entry is about, as ``_source_of`` answers: a buffer read for the
 * first time in the trace is recorded as a source (``_add(t, BUFFER, address, held=True)``: bound by
 * itself, saved when sources are), any other tensor is counted in ``unattributed`` (-1).  A buffer that
 * requires grad, or one saved other than inline, takes Python's ``producer_of``.  New reference. */
static PyObject *unbound_source(Handler *h, PyObject *t, PyObject *key) {
    PyObject *buffers = state_get(h, s_buffers);
    if (buffers == NULL) return NULL;
    PyObject *buffer = PyDict_CheckExact(buffers) ? PyDict_GetItemWithError(buffers, key) : Py_None;
    if (buffer == NULL && PyErr_Occurred()) return NULL;
    /* Not a buffer: a tensor from outside the trace, which Python counts and notes (rare). */
    if (buffer == NULL || (PyTuple_CheckExact(buffer) && PyTuple_GET_SIZE(buffer) == 2 && PyTuple_GET_ITEM(buffer, 0) != t))
        return PyObject_CallMethodOneArg(h->state, s_producer_of, t);
    PyObject *records = held(h, H_RECORDS);
    PyObject *producers = records ? held(h, H_PRODUCERS) : NULL;
    PyObject *save_mode = producers ? state_get(h, s_save_mode) : NULL;
    PyObject *plain = save_mode ? state_get(h, s_plain_save) : NULL;
    if (plain == NULL) return NULL;
    int saving = PyObject_IsTrue(save_mode);
    if (saving > 0) saving = truth_of(PyObject_GetAttr(h->state, s_save_sources));
    if (saving < 0) return NULL;
    PyObject *requires_grad = tensor_get(h, t, G_REQUIRES_GRAD);
    if (requires_grad == NULL) return NULL;
    Py_DECREF(requires_grad);
    if (!PyTuple_CheckExact(buffer) || PyTuple_GET_SIZE(buffer) != 2 || requires_grad != Py_False
            || (saving && plain != Py_True))
        return PyObject_CallMethodOneArg(h->state, s_producer_of, t);
    PyObject *index = PyLong_FromSsize_t(PyList_GET_SIZE(records));
    if (index == NULL) return NULL;
    int rg = 0;
    PyObject *node = NULL, *version = NULL, *entry = NULL;
    if (append_record(h, records, t, h->buffer_kind, PyTuple_GET_ITEM(buffer, 1), &rg, &node) < 0
            || (version = version_of(h, t)) == NULL || (entry = PyTuple_Pack(3, t, index, version)) == NULL
            || PyDict_SetItem(producers, key, entry) < 0
            || (saving && save_inline(h, index, t, 0, version) != 0) || note_finite(h, index, t) < 0) {
        Py_CLEAR(index);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchlens: a buffer could not be saved inline");
    }
    Py_XDECREF(node);
    Py_XDECREF(version);
    Py_XDECREF(entry);
    return index;
}

/* The deepest result nesting walked here; deeper ones go to the Python helper. */
#define MAX_OUTPUT_DEPTH 8

/* A result ``_tensor_leaves`` walks by iterating it: a list, or a tuple iterated as a tuple (structseqs
 * such as ``torch.return_types.max`` and named tuples included). */
static int is_walked_output(PyObject *o) {
    return PyList_CheckExact(o) || (PyTuple_Check(o) && Py_TYPE(o)->tp_iter == PyTuple_Type.tp_iter);
}

/* ``_tensor_leaves(out)`` for the results recorded here: tensors, None and plain values inside such
 * tuples and lists, at any depth up to MAX_OUTPUT_DEPTH.  Appends a ``(slot, tensor)`` pair per tensor
 * to ``leaves`` (the slot an index, or a path tuple below the top level; ``prefix`` is NULL at the top)
 * and returns 1; 0 for a result holding anything else (a tensor subclass, say: the Python helper walks
 * it), -1 on error. */
static int collect_leaves(Handler *h, PyObject *seq, PyObject *prefix, PyObject *leaves, int depth) {
    if (depth >= MAX_OUTPUT_DEPTH) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int tensor = Py_TYPE(item) == (PyTypeObject *)h->tensor_type;
        if (!tensor && !is_walked_output(item)) {
            int plain = PySet_Contains(h->plain_values, (PyObject *)Py_TYPE(item));  /* skipped, as in Python */
            if (plain <= 0) return plain;
            continue;
        }
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL) return -1;
        PyObject *slot;
        if (prefix == NULL) {
            slot = tensor ? index : PyTuple_Pack(1, index);
            if (tensor) Py_INCREF(index);
        } else {
            PyObject *last = PyTuple_Pack(1, index);
            slot = last ? PySequence_Concat(prefix, last) : NULL;
            Py_XDECREF(last);
        }
        Py_DECREF(index);
        if (slot == NULL) return -1;
        int result;
        if (tensor) {
            PyObject *pair = PyTuple_Pack(2, slot, item);
            result = pair != NULL && PyList_Append(leaves, pair) == 0 ? 1 : -1;
            Py_XDECREF(pair);
        } else {
            result = collect_leaves(h, item, slot, leaves, depth + 1);
        }
        Py_DECREF(slot);
        if (result <= 0) return result;
    }
    return 1;
}

/* ``st.record_finite(index, t)`` when the trace records finite flags.  0 or -1. */
static int note_finite(Handler *h, PyObject *index, PyObject *t) {
    PyObject *flags = state_get(h, s_finite_flags);
    if (flags == NULL) return -1;
    if (flags == Py_None) return 0;
    PyObject *r = PyObject_CallMethodObjArgs(h->state, s_record_finite, index, t, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* ``_record_output``: one output of a call with several, bound weakly and saved as ``st.save`` saves. */
static int record_leaf(Handler *h, PyObject *t, PyObject *call_index, PyObject *slot, PyObject *func,
                       PyObject *module_call) {
    PyObject *records = held(h, H_RECORDS);
    PyObject *producers = records ? held(h, H_PRODUCERS) : NULL;
    if (producers == NULL) return -1;
    PyObject *index = PyLong_FromSsize_t(PyList_GET_SIZE(records));
    if (index == NULL) return -1;
    int rg = 0, failed = -1;
    PyObject *version = NULL, *ref = NULL, *entry = NULL, *key = NULL, *node = NULL;
    if (append_record(h, records, t, call_index, slot, &rg, &node) < 0 || (version = version_of(h, t)) == NULL)
        goto done;
    if ((ref = PyWeakref_NewRef(t, NULL)) == NULL || (entry = PyTuple_Pack(3, ref, index, version)) == NULL
            || (key = PyLong_FromVoidPtr(t)) == NULL || PyDict_SetItem(producers, key, entry) < 0)
        goto done;
    if (rg == 1 && watch(h, index, t, func, module_call) < 0) goto done;
    int saving = wanted(h, func, module_call);
    if (saving < 0) goto done;
    if (saving && (saving = save_inline(h, index, t, rg, version)) < 0) goto done;
    if (saving) {
        PyObject *r = PyObject_CallMethodObjArgs(h->state, s_save, index, t, rg ? Py_True : Py_False, NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if (note_finite(h, index, t) < 0) goto done;
    failed = 0;
done:
    Py_DECREF(index);
    Py_XDECREF(version);
    Py_XDECREF(ref);
    Py_XDECREF(entry);
    Py_XDECREF(key);
    Py_XDECREF(node);
    return failed;
}

/* The record of the one tensor a call produced, inlined as in the Python method.  0 or -1. */
static int record_single(Handler *h, PyObject *out, PyObject *call_index, PyObject *first_op,
                         PyObject *func, PyObject *module_call) {
    PyObject *records = held(h, H_RECORDS);
    int rg = 0, failed;
    PyObject *node = NULL;
    if (records == NULL || append_record(h, records, out, call_index, Py_None, &rg, &node) < 0) return -1;
    PyObject *version = version_of(h, out);
    if (version == NULL) {
        Py_XDECREF(node);
        return -1;
    }
    failed = (rg == 1 && watch(h, first_op, out, func, module_call) < 0) || note_finite(h, first_op, out) < 0;
    Py_XDECREF(node);
    if (failed) goto fail;
    int saving = wanted(h, func, module_call);
    if (saving < 0) goto fail;
    PyObject *producers = held(h, H_PRODUCERS);
    if (producers == NULL) goto fail;
    PyObject *key = PyLong_FromVoidPtr(out);
    if (key == NULL) goto fail;
    PyObject *entry = NULL;
    if (saving) {
        PyObject *saved = held(h, H_SAVED);
        PyObject *saved_versions = saved ? held(h, H_SAVED_VERSIONS) : NULL;
        PyObject *kept = saved_versions == NULL ? NULL : rg ? PyObject_CallMethodNoArgs(out, s_detach) : Py_NewRef(out);
        if (kept == NULL) {
            Py_DECREF(key);
            goto fail;
        }
        failed = PyDict_SetItem(saved, first_op, kept) || PyDict_SetItem(saved_versions, first_op, version);
        Py_DECREF(kept);
    }
    if (saving == 1) {
        /* Held until the trace ends anyway: the binding holds the output itself, as Python's hot path does. */
        entry = failed ? NULL : PyTuple_Pack(3, out, first_op, version);
    } else if (!failed) {
        PyObject *ref = PyWeakref_NewRef(out, NULL);
        entry = ref ? PyTuple_Pack(3, ref, first_op, version) : NULL;
        Py_XDECREF(ref);
    }
    failed = entry == NULL || PyDict_SetItem(producers, key, entry);
    Py_XDECREF(entry);
    Py_DECREF(key);
    Py_DECREF(version);
    return failed ? -1 : 0;
fail:
    Py_DECREF(version);
    return -1;
}

/* Scans the arguments.  Returns 1 when the call is for the compiled path and counts its tensors (in
 * containers too), its Parameters and the positional arguments the record does not hold as they are; 0
 * when it is for the Python method; -1 on error. */
static int classify(Handler *h, PyObject *args, PyObject *kwargs, int *tensors, int *params, int *positional) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    int count = 0, found = 0, changed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int kind = kind_of(h, PyTuple_GET_ITEM(args, i), &count, &found);
        if (kind < 0) return -1;
        if (kind == KIND_OTHER) return 0;
        count += kind == KIND_TENSOR || kind == KIND_PARAM;
        found += kind == KIND_PARAM;
        changed += kind != KIND_PLAIN;
    }
    *positional = changed;
    if (kwargs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(kwargs, &pos, &key, &value)) {
            int kind = kind_of(h, value, &count, &found);
            if (kind < 0) return -1;
            if (kind == KIND_OTHER) return 0;
            count += kind == KIND_TENSOR || kind == KIND_PARAM;
            found += kind == KIND_PARAM;
        }
    }
    *tensors = count;
    *params = found;
    return 1;
}

/* What the argument scan fills: the tensors' versions, the parents (a tuple of exactly the parents
 * found) and the Parameters (a list of exactly those found, or NULL: none). */
typedef struct {
    PyObject *producers;
    Bound *bounds;
    int nbound, capacity, nparents, nparams;
    PyObject *parents, *params;
} Scan;

/* One scanned tensor argument: its version first, then its parent or its place among the parameters. */
static int scan_one(Handler *h, Scan *sc, PyObject *slot, PyObject *a) {
    int param = Py_TYPE(a) == (PyTypeObject *)h->parameter_type;
    if (sc->nbound >= sc->capacity || (param ? sc->params == NULL || sc->nparams >= PyList_GET_SIZE(sc->params)
                                             : sc->nparents >= PyTuple_GET_SIZE(sc->parents))) {
        PyErr_SetString(PyExc_RuntimeError, "torchlens: an argument changed while it was scanned");
        return -1;
    }
    PyObject *version = version_of(h, a);
    if (version == NULL) return -1;
    sc->bounds[sc->nbound].t = Py_NewRef(a);
    sc->bounds[sc->nbound].version = version;
    sc->nbound++;
    PyObject *pair;
    if (param) {
        pair = PyTuple_Pack(2, slot, a);
        if (pair == NULL) return -1;
        PyList_SET_ITEM(sc->params, sc->nparams++, pair);
        return 0;
    }
    PyObject *index = parent_of(h, sc->producers, a, version);
    if (index == NULL) return -1;
    pair = PyTuple_Pack(2, slot, index);
    Py_DECREF(index);
    if (pair == NULL) return -1;
    PyTuple_SET_ITEM(sc->parents, sc->nparents++, pair);
    return 0;
}

/* ``st.note_context(call_index)``: the call ran under another grad mode or autocast state than the trace.
 * Its common case here (no autocast anywhere: the context is ``(grad mode, {})``, as
 * ``grad_and_autocast`` gives it), the rest in Python.  0 or -1. */
static int note_context(Handler *h, PyObject *call_index) {
    int autocast = truth_of(PyObject_CallNoArgs(h->any_autocast));
    if (autocast < 0) return -1;
    if (autocast) {
        PyObject *r = PyObject_CallMethodOneArg(h->state, s_note_context, call_index);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    PyObject *trace_context = state_get(h, s_context);
    PyObject *contexts = trace_context ? state_get(h, s_contexts) : NULL;
    PyObject *grad_on = contexts ? PyObject_CallNoArgs(h->grad_enabled) : NULL;
    PyObject *none = grad_on ? PyDict_New() : NULL;
    PyObject *context = none ? PyTuple_Pack(2, grad_on, none) : NULL;
    Py_XDECREF(grad_on);
    Py_XDECREF(none);
    if (context == NULL) return -1;
    int differs = PyObject_RichCompareBool(context, trace_context, Py_NE);
    int failed = differs < 0 || (differs && PyObject_SetItem(contexts, call_index, context) < 0);
    Py_DECREF(context);
    return failed ? -1 : 0;
}

/* Whether a normalisation with running statistics (``h->running_stats``) may write them in its kernel:
 * 0 when its flag (``training``, ``use_input_stats``) is False or None, as eval mode passes it (then
 * ``running_stats_written`` finds nothing to protect), 1 when Python must look, -1 on error. */
static int stats_written(Handler *h, PyObject *func, PyObject *args, PyObject *kwargs) {
    PyObject *flags = PyDict_GetItemWithError(h->running_stats, func);
    if (flags == NULL) return PyErr_Occurred() ? -1 : 1;
    if (!PyTuple_CheckExact(flags) || PyTuple_GET_SIZE(flags) != 2) return 1;
    Py_ssize_t position = PyLong_AsSsize_t(PyTuple_GET_ITEM(flags, 1));
    if (position == -1 && PyErr_Occurred()) return -1;
    PyObject *flag = kwargs != NULL ? PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(flags, 0)) : NULL;
    if (flag == NULL && PyErr_Occurred()) return -1;
    if (flag == NULL) flag = PyTuple_GET_SIZE(args) > position ? PyTuple_GET_ITEM(args, position) : Py_None;
    return flag != Py_False && flag != Py_None;
}

/* Whether an argument ``kind_of`` found plain or a container is a container the record copies: a list,
 * or a tuple holding tensors. */
static int walked(Handler *h, PyObject *a) {
    if (PyList_CheckExact(a)) return 1;
    if (!PyTuple_CheckExact(a)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); i++) {
        if (is_tensor(h, PyTuple_GET_ITEM(a, i))) return 1;
    }
    return 0;
}

/* A container argument at ``key`` (a position or a keyword), as ``_scan_container`` records it: each
 * tensor at slot ``(key, i)``, in order, and the container as recorded returned (a copy with its
 * tensors blanked; a new reference). */
static PyObject *scan_container(Handler *h, Scan *sc, PyObject *key, PyObject *a) {
    /* Copied first (a tuple too: a full slice of a tuple is the tuple itself), so the scan reads only
     * the copy, whatever the list's owner does. */
    int is_list = PyList_CheckExact(a);
    PyObject *inner;
    if (is_list) {
        inner = PyList_GetSlice(a, 0, PyList_GET_SIZE(a));
    } else if ((inner = PyTuple_New(PyTuple_GET_SIZE(a))) != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a); i++) PyTuple_SET_ITEM(inner, i, Py_NewRef(PyTuple_GET_ITEM(a, i)));
    }
    if (inner == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(inner);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(inner, i);
        if (!is_tensor(h, item)) continue;
        /* The tensor stays held by the scan (``bounds``) once blanked in the copy. */
        PyObject *index = PyLong_FromSsize_t(i);
        PyObject *slot = index ? PyTuple_Pack(2, key, index) : NULL;
        Py_XDECREF(index);
        int failed = slot == NULL || scan_one(h, sc, slot, item) < 0;
        Py_XDECREF(slot);
        if (failed) {
            Py_DECREF(inner);
            return NULL;
        }
        if (is_list) {
            PyList_SET_ITEM(inner, i, Py_NewRef(Py_None));
        } else {
            PyTuple_SET_ITEM(inner, i, Py_NewRef(Py_None));  /* a new tuple: ours alone */
        }
        Py_DECREF(item);
    }
    return inner;
}

/* Whether the next call is at an intervention's label site (its position, ``len(calls)``, is in the state's
 * ``site_calls``): that call is recorded here as any other, then handed to ``intervention.at_call``, which
 * applies the action (``apply_site``).  1, 0 or -1. */
static int at_site_call(Handler *h) {
    PyObject *site_calls = PyDict_GetItemWithError(h->state_dict, s_site_calls);
    if (site_calls == NULL || site_calls == Py_None) return site_calls == NULL && PyErr_Occurred() ? -1 : 0;
    PyObject *calls = held(h, H_CALLS);
    if (calls == NULL) return -1;
    PyObject *position = PyLong_FromSsize_t(PyList_GET_SIZE(calls));
    if (position == NULL) return -1;
    int found = PySet_Contains(site_calls, position);
    Py_DECREF(position);
    return found;
}

/* Whether one of ``leaves`` (the (slot, tensor) pairs of a call returning several tensors) is one of ``args``
 * itself: 1 or 0, -1 on error.  Checked here so that the common call, returning new tensors, costs no call. */
static int returns_an_argument(PyObject *leaves, PyObject *args) {
    PyObject *seq = PySequence_Fast(leaves, "torchlens: the output leaves are no sequence");
    if (seq == NULL) return -1;
    int found = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && !found; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) continue;
        PyObject *t = PyTuple_GET_ITEM(pair, 1);
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(args) && !found; j++) found = PyTuple_GET_ITEM(args, j) == t;
    }
    Py_DECREF(seq);
    return found;
}

/* A label site's call, recorded: what ``intervention.at_call`` returns to the model (the action's value, or
 * ``out``).  ``leaves``: the call's (slot, tensor) pairs, NULL for one tensor out. */
static PyObject *apply_site(Handler *h, PyObject *call_index, PyObject *first_op, PyObject *out, PyObject *leaves,
                            PyObject *func, PyObject *args, PyObject *kw) {
    PyObject *runtime = state_get(h, s_intervention);
    if (runtime == NULL) return NULL;
    PyObject *pairs = leaves;
    if (pairs == NULL) {
        PyObject *pair = PyTuple_Pack(2, Py_None, out);
        pairs = pair != NULL ? PyTuple_Pack(1, pair) : NULL;
        Py_XDECREF(pair);
        if (pairs == NULL) return NULL;
    }
    PyObject *aargv[] = {runtime, h->state, call_index, first_op, out, pairs, func, args, kw};
    PyObject *result = PyObject_VectorcallMethod(s_at_call, aargv, 9, NULL);
    if (leaves == NULL) Py_DECREF(pairs);
    return result;
}

static PyObject *handler_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Handler *h = (Handler *)self;
    if (h->state_dict == NULL) {
        PyErr_SetString(PyExc_TypeError, "torchlens: a Handler template records for no capture: bind() it first");
        return NULL;
    }
    /* Another thread, handed the mode with its forker's torch state (TorchScript's fork): the Python method runs
     * its call untraced. */
    if (PyThread_get_thread_ident() != h->thread) return call_method(h, argv, nargsf, kwnames);
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 2 || nargs > 4) return call_method(h, argv, nargsf, kwnames);
    PyObject *func = argv[0];
    PyObject *args = nargs > 2 ? argv[2] : empty_tuple;
    PyObject *kwargs = nargs > 3 ? argv[3] : Py_None;
    if (!PyTuple_CheckExact(args) || (kwargs != Py_None && !PyDict_CheckExact(kwargs)))
        return call_method(h, argv, nargsf, kwnames);
    int found = PySet_Contains(h->off_hot_path, func);
    if (found < 0) return NULL;
    if (found) {
        /* ``x.shape``, ``x.size()``: run unrecorded (``_not_an_op``), but for NumPy views and ``x.data``. */
        int plain = PySet_Contains(h->not_ops, func);
        if (plain > 0) plain = !PySet_Contains(h->numpy_views, func);
        if (plain < 0) return NULL;
        if (!plain) return call_method(h, argv, nargsf, kwnames);
        return PyObject_Call(func, args, kwargs == Py_None || PyDict_GET_SIZE(kwargs) == 0 ? NULL : kwargs);
    }
    PyObject *compiling = PyDict_GetItemWithError(h->compiler_dict, s_is_compiling);
    if (compiling == NULL && PyErr_Occurred()) return NULL;
    if (compiling != NULL) {
        int on = PyObject_IsTrue(compiling);
        if (on < 0) return NULL;
        if (on) return call_method(h, argv, nargsf, kwnames);
    }
    int at_site = at_site_call(h);  /* recorded here all the same, then handed to ``apply_site`` */
    if (at_site < 0) return NULL;
    if (kwargs == Py_None || PyDict_GET_SIZE(kwargs) == 0) kwargs = NULL;  /* ``kwargs or _NO_KWARGS`` */
    int tensors = 0, nparams_all = 0, positional = 0;
    found = classify(h, args, kwargs, &tensors, &nparams_all, &positional);
    if (found <= 0) return found < 0 ? NULL : call_method(h, argv, nargsf, kwnames);

    /* From here on the call is recorded here: every error returns NULL with the exception set. */
    PyObject *result = NULL, *out = NULL, *skeleton = NULL, *kw_skeleton = NULL, *parents = NULL;
    PyObject *params = NULL, *module_call = NULL, *t0 = NULL, *t1 = NULL, *leaves = NULL, *pairs = NULL;
    PyObject *site = NULL, *code = NULL, *line = NULL, *call_index = NULL, *first_op = NULL;
    PyObject *written = NULL, *call = NULL;
    PyObject *kw = kwargs != NULL ? kwargs : h->no_kwargs;
    Bound small[MAX_TENSORS];
    Scan sc = {.bounds = tensors <= MAX_TENSORS ? small : PyMem_Malloc(tensors * sizeof(Bound)), .capacity = tensors};
    if (sc.bounds == NULL) return PyErr_NoMemory();
    Py_ssize_t n = PyTuple_GET_SIZE(args);

    if ((sc.producers = held(h, H_PRODUCERS)) == NULL) goto done;
    /* Filled in place: a tuple of exactly the parents found, a list of exactly the parameters. */
    if ((parents = sc.parents = PyTuple_New(tensors - nparams_all)) == NULL) goto done;
    if (nparams_all > 0 && (params = sc.params = PyList_New(nparams_all)) == NULL) goto done;
    if (positional == 0) {
        skeleton = Py_NewRef(args);
    } else {
        /* The arguments as recorded: tensors blanked, containers copied, every other value held as it is. */
        if ((skeleton = PyTuple_New(n)) == NULL) goto done;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *a = PyTuple_GET_ITEM(args, i), *inner;
            int tensor = is_tensor(h, a);
            if (tensor || walked(h, a)) {
                PyObject *slot = PyLong_FromSsize_t(i);
                if (slot == NULL) goto done;
                inner = !tensor ? scan_container(h, &sc, slot, a) : scan_one(h, &sc, slot, a) < 0 ? NULL : Py_NewRef(Py_None);
                Py_DECREF(slot);
                if (inner == NULL) goto done;
            } else {
                inner = Py_NewRef(a);
            }
            PyTuple_SET_ITEM(skeleton, i, inner);
        }
    }
    kw_skeleton = Py_NewRef(kw);
    if (kwargs != NULL) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(kwargs, &pos, &key, &value)) {
            int tensor = is_tensor(h, value);
            if (!tensor && !walked(h, value)) continue;
            if (kw_skeleton == kwargs) {
                Py_SETREF(kw_skeleton, PyDict_Copy(kwargs));
                if (kw_skeleton == NULL) goto done;
            }
            Py_INCREF(key);
            Py_INCREF(value);
            PyObject *inner = tensor ? (scan_one(h, &sc, key, value) < 0 ? NULL : Py_NewRef(Py_None))
                                     : scan_container(h, &sc, key, value);
            int failed = inner == NULL || PyDict_SetItem(kw_skeleton, key, inner) < 0;
            Py_XDECREF(inner);
            Py_DECREF(key);
            Py_DECREF(value);
            if (failed) goto done;
        }
    }
    int nbound = sc.nbound;
    Bound *bounds = sc.bounds;

    /* Copy-on-write: a write predicted by name or by keyword must not alter what was saved. */
    if (nbound > 0) {
        PyObject *saved = held(h, H_SAVED);
        if (saved == NULL) goto done;
        if (PyDict_Check(saved) ? PyDict_GET_SIZE(saved) > 0 : PyObject_IsTrue(saved)) {
            PyObject *verdict = PyDict_GetItemWithError(h->inplace_cache, func);
            if (verdict == NULL && PyErr_Occurred()) goto done;
            int protect = verdict != Py_False;
            if (protect && verdict != NULL && verdict != Py_True && (protect = stats_written(h, func, args, kwargs)) < 0)
                goto done;
            if (!protect && kwargs != NULL) {
                protect = PyDict_Contains(kwargs, s_out);
                if (protect < 0) goto done;
                if (!protect) {
                    PyObject *inplace = PyDict_GetItemWithError(kwargs, s_inplace);
                    if (inplace == NULL && PyErr_Occurred()) goto done;
                    protect = inplace != NULL ? PyObject_IsTrue(inplace) : 0;
                    if (protect < 0) goto done;
                }
            }
            if (protect) {
                PyObject *pargv[] = {h->state, func, args, kw};
                PyObject *r = PyObject_Vectorcall(h->protect, pargv, 4, NULL);
                if (r == NULL) goto done;
                Py_DECREF(r);
            }
        }
    }
    PyObject *stack = held(h, H_MODULE_STACK);
    if (stack == NULL) goto done;
    Py_ssize_t depth = PyList_CheckExact(stack) ? PyList_GET_SIZE(stack) : PyObject_Length(stack);
    if (depth < 0) goto done;
    if (depth > 0) {
        module_call = PyList_CheckExact(stack) ? Py_NewRef(PyList_GET_ITEM(stack, depth - 1))
                                               : PySequence_GetItem(stack, depth - 1);
    } else {
        module_call = PyLong_FromLong(-1);
    }
    if (module_call == NULL) goto done;
    long module_index = PyLong_Check(module_call) ? PyLong_AsLong(module_call) : 0;
    if (module_index == -1 && PyErr_Occurred()) goto done;

    t0 = now_ns();
    if (t0 == NULL) goto done;
    out = PyObject_Call(func, args, kwargs);
    if (out == NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        PyObject *fargv[] = {h->state, func, module_call, value};
        PyObject *r = PyObject_VectorcallMethod(s_note_failure, fargv, 4, NULL);
        if (r == NULL) {  /* raised while noting it: that error, the call's as its context */
            PyObject *type2, *value2, *tb2;
            PyErr_Fetch(&type2, &value2, &tb2);
            PyErr_NormalizeException(&type2, &value2, &tb2);
            PyException_SetContext(value2, value);  /* steals value */
            Py_XDECREF(type);
            Py_XDECREF(tb);
            PyErr_Restore(type2, value2, tb2);
        } else {
            Py_DECREF(r);
            PyErr_Restore(type, value, tb);
        }
        goto done;
    }
    t1 = now_ns();
    if (t1 == NULL) goto done;
    int single = PyObject_IsInstance(out, h->tensor_type);
    if (single < 0) goto done;
    if (!single && !is_walked_output(out)) {
        /* A plain value (``x.is_nested``, ``x.dim()`` of a subclass): not an op, as ``_output_leaves`` finds
         * for any call but ``__setitem__`` and the collectives, whose in-place verdict is never False, and a
         * call given ``out=`` that returns None (``split_with_sizes_copy``): its out= tensors are its outputs. */
        int plain = PySet_Contains(h->plain_values, (PyObject *)Py_TYPE(out));
        PyObject *verdict = plain > 0 ? PyDict_GetItemWithError(h->inplace_cache, func) : NULL;
        if (plain < 0 || (verdict == NULL && PyErr_Occurred())) goto done;
        int wrote_out = out == Py_None && kwargs != NULL ? PyDict_Contains(kwargs, s_out) : 0;
        if (wrote_out < 0) goto done;
        if (verdict == Py_False && !wrote_out) {
            if (forget_unrecorded_reads(h) < 0) goto done;
            result = Py_NewRef(out);
            goto done;
        }
    }
    if (!single && is_walked_output(out)) {
        /* Several tensors (split, chunk, torch.return_types.max, LSTM's (out, (h, c))): recorded here. */
        if ((pairs = PyList_New(0)) == NULL) goto done;
        int walked_here = collect_leaves(h, out, NULL, pairs, 0);
        if (walked_here < 0) goto done;
        if (!walked_here) Py_CLEAR(pairs);
    }
    if (!single && pairs == NULL) {
        PyObject *largv[] = {func, out, args, kw};
        leaves = PyObject_Vectorcall(h->output_leaves, largv, 4, NULL);
        if (leaves == NULL) goto done;
    }
    PyObject *found_leaves = pairs != NULL ? pairs : leaves;
    if (found_leaves != NULL) {
        int any = PyObject_IsTrue(found_leaves);
        if (any < 0) goto done;
        if (!any) {  /* no tensor produced: not an op */
            if (forget_unrecorded_reads(h) < 0) goto done;
            result = Py_NewRef(out);
            goto done;
        }
    }

    if (find_site(h, func, module_call, module_index, &site, &code, &line) < 0) goto done;
    PyObject *calls = held(h, H_CALLS);
    PyObject *records = calls ? held(h, H_RECORDS) : NULL;
    if (records == NULL) goto done;
    call_index = PyLong_FromSsize_t(PyList_GET_SIZE(calls));
    first_op = call_index ? PyLong_FromSsize_t(PyList_GET_SIZE(records)) : NULL;
    if (first_op == NULL) goto done;
    for (int i = 0; i < nbound; i++) {
        int moved = bounds[i].version == Py_None;
        if (!moved) {
            PyObject *after = read_version(h, bounds[i].t);
            if (after == NULL) goto done;
            moved = PyObject_RichCompareBool(after, bounds[i].version, Py_NE);
            Py_DECREF(after);
            if (moved < 0) goto done;
        }
        /* A torch.distributed collective (its tensors found by ``_output_leaves``) writes its argument without
         * moving the version counter: asked on its last argument all the same; for any other call returning
         * no tensor of its own nothing moved means nothing written, as ``_written_arguments`` finds. */
        if (!moved && leaves != NULL && i == nbound - 1) moved = 1;
        if (moved) {  /* a write (or an inference tensor): which ones */
            PyObject *versions = versions_list(bounds, nbound);
            if (versions == NULL) goto done;
            PyObject *wargv[] = {func, args, kw, versions, out};
            written = PyObject_Vectorcall(h->written_arguments, wargv, 5, NULL);
            Py_DECREF(versions);
            if (written == NULL) goto done;
            if (written == Py_None) Py_CLEAR(written);
            break;
        }
    }
    PyObject *save_mode = state_get(h, s_save_mode);
    if (save_mode == NULL) goto done;
    int saving = PyObject_IsTrue(save_mode);
    if (saving < 0) goto done;
    if (saving) {
        int now = h->fast != NULL ? h->fast->context() : -1;  /* grad mode | autocast << 1, or ask Python */
        PyObject *grad_on = now >= 0 ? Py_NewRef(now & 1 ? Py_True : Py_False) : PyObject_CallNoArgs(h->grad_enabled);
        if (grad_on == NULL) goto done;
        PyObject *trace_grad = state_get(h, s_grad_enabled);
        int differs = trace_grad == NULL ? -1 : grad_on != trace_grad;
        Py_DECREF(grad_on);
        if (differs < 0) goto done;
        if (!differs) differs = now >= 0 ? (now & 2) != 0 : truth_of(PyObject_CallNoArgs(h->any_autocast));
        if (differs < 0) goto done;
        if (!differs) {
            PyObject *any = state_get(h, s_any_autocast);
            differs = any ? PyObject_IsTrue(any) : -1;
            if (differs < 0) goto done;
        }
        if (differs) {
            if (note_context(h, call_index) < 0) goto done;
        }
    }
    Py_ssize_t outputs = 1;
    if (found_leaves != NULL && (outputs = PyObject_Length(found_leaves)) < 0) goto done;
    PyObject *num_outputs = PyLong_FromSsize_t(outputs);
    if (num_outputs == NULL) goto done;
    call = PyTuple_Pack(14, func, skeleton, PyDict_GET_SIZE(kw_skeleton) ? kw_skeleton : h->no_kwargs, parents,
                        params != NULL ? params : empty_tuple, module_call, code, line, t0, t1, first_op,
                        num_outputs, written != NULL ? Py_True : Py_False, site);
    Py_DECREF(num_outputs);
    if (call == NULL || PyList_Append(calls, call)) goto done;
    if (written != NULL) {
        PyObject *r = PyObject_CallMethodObjArgs(h->state, s_note_writes, written, first_op, NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if (found_leaves != NULL && written == NULL && module_index >= 0 && (PyTuple_Check(out) || PyList_Check(out))) {
        int returned = returns_an_argument(found_leaves, args);
        if (returned < 0) goto done;
        if (returned) {
            /* Some of its outputs are its arguments themselves: ``st.note_returned_arguments``, as in Python. */
            PyObject *r = PyObject_CallMethodObjArgs(h->state, s_note_returned_arguments, out, args, found_leaves,
                                                     first_op, module_call, func, NULL);
            if (r == NULL) goto done;
            Py_DECREF(r);
        }
    }
    if (pairs != NULL) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); i++) {
            PyObject *pair = PyList_GET_ITEM(pairs, i);  /* ours alone: nothing else changes it */
            if (record_leaf(h, PyTuple_GET_ITEM(pair, 1), call_index, PyTuple_GET_ITEM(pair, 0), func, module_call) < 0)
                goto done;
        }
    } else if (leaves != NULL) {
        PyObject *iter = PyObject_GetIter(leaves);
        if (iter == NULL) goto done;
        PyObject *leaf;
        while ((leaf = PyIter_Next(iter)) != NULL) {
            PyObject *pair = PySequence_Tuple(leaf);
            Py_DECREF(leaf);
            if (pair == NULL || PyTuple_GET_SIZE(pair) != 2) {
                if (pair != NULL) {
                    PyErr_SetString(PyExc_ValueError, "torchlens: an output leaf is not a (slot, tensor) pair");
                    Py_DECREF(pair);
                }
                Py_DECREF(iter);
                goto done;
            }
            PyObject *rargv[] = {h->state, call_index, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1),
                                 func, module_call};
            PyObject *r = PyObject_Vectorcall(h->record_output, rargv, 6, NULL);
            Py_DECREF(pair);
            if (r == NULL) {
                Py_DECREF(iter);
                goto done;
            }
            Py_DECREF(r);
        }
        Py_DECREF(iter);
        if (PyErr_Occurred()) goto done;
    } else {
        if (written == NULL && module_index >= 0 && n > 0 && out == PyTuple_GET_ITEM(args, 0)) {
            /* It returned its first argument itself: ``st.note_pass_through``, as the Python method does. */
            PyObject *r = PyObject_CallMethodObjArgs(h->state, s_note_pass_through, out, first_op, module_call,
                                                     func, NULL);
            if (r == NULL) goto done;
            Py_DECREF(r);
        }
        if (record_single(h, out, call_index, first_op, func, module_call) < 0) goto done;
    }
    result = at_site ? apply_site(h, call_index, first_op, out, found_leaves, func, args, kw) : Py_NewRef(out);
done:
    release_bounds(sc.bounds, sc.nbound);
    if (sc.bounds != small) PyMem_Free(sc.bounds);
    Py_XDECREF(out);
    Py_XDECREF(skeleton);
    Py_XDECREF(kw_skeleton);
    Py_XDECREF(parents);
    Py_XDECREF(params);
    Py_XDECREF(module_call);
    Py_XDECREF(t0);
    Py_XDECREF(t1);
    Py_XDECREF(leaves);
    Py_XDECREF(pairs);
    Py_XDECREF(site);
    Py_XDECREF(code);
    Py_XDECREF(line);
    Py_XDECREF(call_index);
    Py_XDECREF(first_op);
    Py_XDECREF(written);
    Py_XDECREF(call);
    return result;
}

/* ----- the type ------------------------------------------------------------------------------- */

#define HANDLER_OBJECTS(X) \
    X(mode_ref) X(method) X(state) X(state_dict) X(off_hot_path) X(not_ops) X(numpy_views) X(compiler_dict) X(tensor_type) \
    X(parameter_type) X(function_type) X(plain_values) X(tuple_values) X(inplace_cache) X(running_stats) X(buffer_kind) X(no_kwargs) \
    X(protect) X(output_leaves) X(record_output) X(written_arguments) X(shape_of) X(verdicts) X(locate) \
    X(dispatched_site) X(call_impl) X(call_impl_inner) X(grad_enabled) X(any_autocast) X(getters)

static int handler_traverse(Handler *h, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(h->name);
    HANDLER_OBJECTS(VISIT)
#undef VISIT
    for (int i = 0; i < N_HELD; i++) Py_VISIT(h->held[i]);
    for (int i = 0; i < SITES_SEEN; i++) Py_VISIT(h->sites[i].site);
    return 0;
}

static int handler_clear(Handler *h) {
#define CLEAR(name) Py_CLEAR(h->name);
    HANDLER_OBJECTS(CLEAR)
#undef CLEAR
    for (int i = 0; i < N_HELD; i++) Py_CLEAR(h->held[i]);
    for (int i = 0; i < SITES_SEEN; i++) Py_CLEAR(h->sites[i].site);
    return 0;
}

static void handler_dealloc(Handler *h) {
    PyObject_GC_UnTrack(h);
    handler_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *handler_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {
        "mode", "method", "state", "off_hot_path", "not_ops", "numpy_views", "compiler_dict", "tensor_type", "parameter_type",
        "function_type", "plain_values", "tuple_values", "inplace_cache", "running_stats", "buffer_kind", "no_kwargs", "protect",
        "output_leaves", "record_output", "written_arguments", "shape_of", "verdicts", "locate",
        "dispatched_site", "call_impl", "call_impl_inner", "grad_enabled", "any_autocast", "getters", "user", "skip",
        "dispatch", "stop", "boundary", "fast_reads", NULL};
    PyObject *mode, *fast_reads = Py_None;
    Handler *h = (Handler *)type->tp_alloc(type, 0);
    if (h == NULL) return NULL;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOO!O!O!O!OOOO!O!O!O!OO!OOOOOO!OOOOOOOlllll|O:Handler", names, &mode, &h->method, &h->state,
            &PyFrozenSet_Type, &h->off_hot_path, &PyFrozenSet_Type, &h->not_ops, &PyFrozenSet_Type,
            &h->numpy_views, &PyDict_Type, &h->compiler_dict, &h->tensor_type,
            &h->parameter_type, &h->function_type, &PyFrozenSet_Type, &h->plain_values, &PyFrozenSet_Type,
            &h->tuple_values, &PyDict_Type, &h->inplace_cache, &PyDict_Type, &h->running_stats, &h->buffer_kind, &PyDict_Type, &h->no_kwargs, &h->protect,
            &h->output_leaves, &h->record_output, &h->written_arguments, &h->shape_of, &PyDict_Type,
            &h->verdicts, &h->locate, &h->dispatched_site, &h->call_impl, &h->call_impl_inner,
            &h->grad_enabled, &h->any_autocast, &h->getters, &h->user, &h->skip, &h->dispatch, &h->stop, &h->boundary,
            &fast_reads)) {
        memset(&h->mode_ref, 0, sizeof(Handler) - offsetof(Handler, mode_ref));
        Py_DECREF(h);
        return NULL;
    }
#define HOLD(name) Py_XINCREF(h->name);
    HANDLER_OBJECTS(HOLD)
#undef HOLD
    if (mode != Py_None || h->state != Py_None) {  /* (both None: a template, see handler_bind) */
        h->mode_ref = PyWeakref_NewRef(mode, NULL);
        h->state_dict = PyObject_GenericGetDict(h->state, NULL);
        h->thread = PyThread_get_thread_ident();
        if (h->mode_ref == NULL || h->state_dict == NULL || hold_containers(h) < 0) {
            Py_DECREF(h);
            return NULL;
        }
    }
    if (h->getters != Py_None) {
        int fits = PyTuple_CheckExact(h->getters) && PyTuple_GET_SIZE(h->getters) == N_GETTERS;
        for (int i = 0; fits && i < N_GETTERS; i++) {
            PyTypeObject *d = Py_TYPE(PyTuple_GET_ITEM(h->getters, i));
            fits = d->tp_descr_get != NULL && d->tp_descr_set != NULL;  /* data descriptors only */
        }
        if (!fits) {
            PyErr_SetString(PyExc_TypeError, "Handler: getters must be a tuple of the tensor attributes' data descriptors");
            Py_DECREF(h);
            return NULL;
        }
    }
    if (fast_reads_of(fast_reads, "Handler", &h->fast) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    if (!PyType_Check(h->tensor_type) || !PyType_Check(h->parameter_type) || !PyType_Check(h->function_type)) {
        PyErr_SetString(PyExc_TypeError, "Handler: tensor_type, parameter_type and function_type must be types");
        Py_DECREF(h);
        return NULL;
    }
    h->vectorcall = handler_vectorcall;
    return (PyObject *)h;
}

/* ``template.bind(mode, state, locate)``: a handler for one capture, sharing everything else the
 * template was made with.  The template is made once per process, so a trace does not pay for parsing
 * the thirty objects every handler holds. */
static PyObject *handler_bind(Handler *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "Handler.bind(mode, state, locate) takes three arguments");
        return NULL;
    }
    Handler *h = (Handler *)Py_TYPE(t)->tp_alloc(Py_TYPE(t), 0);
    if (h == NULL) return NULL;
#define COPY(name) h->name = Py_XNewRef(t->name);
    HANDLER_OBJECTS(COPY)
#undef COPY
    h->user = t->user;
    h->skip = t->skip;
    h->dispatch = t->dispatch;
    h->stop = t->stop;
    h->boundary = t->boundary;
    h->fast = t->fast;
    Py_CLEAR(h->mode_ref);
    Py_CLEAR(h->state_dict);
    Py_XSETREF(h->state, Py_NewRef(args[1]));
    Py_XSETREF(h->locate, Py_NewRef(args[2]));
    h->mode_ref = PyWeakref_NewRef(args[0], NULL);
    h->state_dict = h->mode_ref ? PyObject_GenericGetDict(h->state, NULL) : NULL;
    h->thread = PyThread_get_thread_ident();  /* bound as the mode is made, on the tracing thread */
    if (h->state_dict == NULL || hold_containers(h) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    h->vectorcall = handler_vectorcall;
    return (PyObject *)h;
}

static PyMethodDef handler_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))handler_bind, METH_FASTCALL,
     "bind(mode, state, locate): a handler for one capture, sharing the template's other objects."},
    {NULL},
};

static PyObject *handler_self(Handler *h, void *closure) {
    /* torch checks that the handler's __self__ is the mode it looked it up on. */
    PyObject *mode = h->mode_ref ? PyWeakref_GetObject(h->mode_ref) : Py_None;
    return Py_NewRef(mode);
}

static PyGetSetDef handler_getset[] = {
    {"__self__", (getter)handler_self, NULL, "the capture mode this handler records for", NULL},
    {NULL},
};

static PyMemberDef handler_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Handler, vectorcall), READONLY, NULL},
    {"state", T_OBJECT, offsetof(Handler, state), READONLY, "the capture state it records into"},
    {NULL},
};

static PyTypeObject HandlerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._capture.Handler",
    .tp_doc = "CaptureMode.__torch_function__ for a plain capture, compiled.",
    .tp_basicsize = sizeof(Handler),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = handler_new,
    .tp_dealloc = (destructor)handler_dealloc,
    .tp_traverse = (traverseproc)handler_traverse,
    .tp_clear = (inquiry)handler_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Handler, vectorcall),
    .tp_getset = handler_getset,
    .tp_members = handler_members,
    .tp_methods = handler_methods,
};

/* ----- the slot torch looks the handler up in ------------------------------------------------ */

/* ``CaptureMode.__torch_function__``: a data descriptor answering, for a mode, its compiled handler
 * (``mode.__dict__[key]``) when it has one, and otherwise, or while Dynamo compiles (it traces the
 * handler of a mode on the stack, torch.cond's bodies for instance, and can trace only Python), the
 * Python method bound to the mode.  Looked up on the class, it is the Python method itself. */
typedef struct {
    PyObject_HEAD
    PyObject *method;
    PyObject *compiler_dict;
    PyObject *key;
} Slot;

static PyObject *slot_get(PyObject *self, PyObject *obj, PyObject *type) {
    Slot *slot = (Slot *)self;
    if (obj == NULL || obj == Py_None) return Py_NewRef(slot->method);
    PyObject *compiling = PyDict_GetItemWithError(slot->compiler_dict, s_is_compiling);
    if (compiling == NULL && PyErr_Occurred()) return NULL;
    int on = compiling != NULL ? PyObject_IsTrue(compiling) : 0;
    if (on < 0) return NULL;
    if (!on) {
        PyObject **dictptr = _PyObject_GetDictPtr(obj);
        PyObject *handler = dictptr != NULL && *dictptr != NULL ? PyDict_GetItemWithError(*dictptr, slot->key) : NULL;
        if (handler != NULL) return Py_NewRef(handler);
        if (PyErr_Occurred()) return NULL;
    }
    return PyMethod_New(slot->method, obj);
}

static int slot_set(PyObject *self, PyObject *obj, PyObject *value) {
    PyErr_SetString(PyExc_AttributeError, "a capture mode's __torch_function__ is read-only");
    return -1;
}

static int slot_traverse(Slot *slot, visitproc visit, void *arg) {
    Py_VISIT(slot->method);
    Py_VISIT(slot->compiler_dict);
    Py_VISIT(slot->key);
    return 0;
}

static int slot_clear(Slot *slot) {
    Py_CLEAR(slot->method);
    Py_CLEAR(slot->compiler_dict);
    Py_CLEAR(slot->key);
    return 0;
}

static void slot_dealloc(Slot *slot) {
    PyObject_GC_UnTrack(slot);
    slot_clear(slot);
    Py_TYPE(slot)->tp_free((PyObject *)slot);
}

static PyObject *slot_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"method", "compiler_dict", "key", NULL};
    PyObject *method, *compiler_dict, *key;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!U:HandlerSlot", names, &method, &PyDict_Type, &compiler_dict, &key))
        return NULL;
    Slot *slot = (Slot *)type->tp_alloc(type, 0);
    if (slot == NULL) return NULL;
    slot->method = Py_NewRef(method);
    slot->compiler_dict = Py_NewRef(compiler_dict);
    slot->key = Py_NewRef(key);
    return (PyObject *)slot;
}

static PyMemberDef slot_members[] = {
    {"__func__", T_OBJECT, offsetof(Slot, method), READONLY, "the Python method"},
    {NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._capture.HandlerSlot",
    .tp_doc = "CaptureMode.__torch_function__: the compiled handler of a mode that has one, else the method.",
    .tp_basicsize = sizeof(Slot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = slot_new,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_traverse = (traverseproc)slot_traverse,
    .tp_clear = (inquiry)slot_clear,
    .tp_descr_get = slot_get,
    .tp_descr_set = slot_set,
    .tp_members = slot_members,
};

static struct PyModuleDef capture_module = {
    PyModuleDef_HEAD_INIT, "_capture", "torchlens's capture hot path, compiled.", -1, NULL,
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL;

PyMODINIT_FUNC PyInit__capture(void) {
    INTERN(s_version, "_version") INTERN(s_shape, "shape") INTERN(s_dtype, "dtype") INTERN(s_device, "device")
    INTERN(s_requires_grad, "requires_grad") INTERN(s_grad_fn, "grad_fn") INTERN(s_detach, "detach")
    INTERN(s_producers, "producers") INTERN(s_calls, "calls") INTERN(s_records, "records")
    INTERN(s_saved, "saved") INTERN(s_saved_versions, "saved_versions") INTERN(s_module_stack, "module_stack")
    INTERN(s_call_frames, "call_frames") INTERN(s_save_mode, "save_mode") INTERN(s_grad_enabled, "grad_enabled")
    INTERN(s_any_autocast, "any_autocast") INTERN(s_grads, "grads") INTERN(s_producer_of, "producer_of")
    INTERN(s_version_m, "version") INTERN(s_note_failure, "note_failure") INTERN(s_note_context, "note_context")
    INTERN(s_note_writes, "note_writes") INTERN(s_note_pass_through, "note_pass_through")
    INTERN(s_note_returned_arguments, "note_returned_arguments") INTERN(s_wants, "wants") INTERN(s_watch, "watch")
    INTERN(s_is_compiling, "_is_compiling_flag") INTERN(s_out, "out") INTERN(s_inplace, "inplace") INTERN(s_torch_function, "__torch_function__")
    INTERN(s_save, "save") INTERN(s_finite_flags, "finite_flags") INTERN(s_record_finite, "record_finite") INTERN(s_plain_save, "plain_save") INTERN(s_buffers, "buffers") INTERN(s_save_sources, "save_sources") INTERN(s_context, "context") INTERN(s_contexts, "contexts")
    INTERN(s_recent_alias_reads, "recent_alias_reads") INTERN(s_forget_unrecorded_reads, "forget_unrecorded_reads")
    INTERN(s_site_calls, "site_calls") INTERN(s_intervention, "intervention") INTERN(s_at_call, "at_call")
    if ((empty_tuple = PyTuple_New(0)) == NULL) return NULL;
    getter_names[G_VERSION] = s_version;
    getter_names[G_SHAPE] = s_shape;
    getter_names[G_DTYPE] = s_dtype;
    getter_names[G_DEVICE] = s_device;
    getter_names[G_REQUIRES_GRAD] = s_requires_grad;
    getter_names[G_GRAD_FN] = s_grad_fn;
    held_names[H_CALLS] = s_calls;
    held_names[H_RECORDS] = s_records;
    held_names[H_PRODUCERS] = s_producers;
    held_names[H_SAVED] = s_saved;
    held_names[H_SAVED_VERSIONS] = s_saved_versions;
    held_names[H_MODULE_STACK] = s_module_stack;
    held_names[H_CALL_FRAMES] = s_call_frames;
    if (PyType_Ready(&HandlerType) < 0 || PyType_Ready(&SlotType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&capture_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0
            || PyModule_AddObjectRef(m, "Handler", (PyObject *)&HandlerType) < 0
            || PyModule_AddObjectRef(m, "HandlerSlot", (PyObject *)&SlotType) < 0
            || add_module_recorder(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
