/* Module calls in C: ``ModuleCallTracker``'s ``record_call`` (capture/modules.py) for the common call.
 *
 * Part of the ``_capture`` module (``_capture.c`` adds its type, ``ModuleRecorder``); see
 * torchlens/capture/modules.py for how it is bound to a trace and put in place of ``nn.Module._call_impl``.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#include "_capture.h"

/* ``record_call`` (capture/modules.py) for the common module call: made on the tracing thread, from a
 * user frame or by a torch module's forward (nn.Sequential's) inside a recorded call, with no profiler
 * markers or progress bar.  Every other call is handed whole to the Python ``record_call``.  Put in
 * place as ``nn.Module._call_impl``, it binds to the module like a function. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;           /* attributes (capture/call_impl.py marks every replacement) */
    PyObject *impl;           /* the _call_impl it runs the call with */
    PyObject *fallback;       /* the Python record_call */
    PyObject *state;
    PyObject *skip;           /* set of ids of modules whose calls are not module calls */
    PyObject *stack, *calls, *call_frames, *producers;
    PyObject *verdicts;
    PyObject *bound_all;      /* value -> tuple of the bound producers of the tensors in it */
    PyObject *outside;        /* [frame, its answer]: torch code calling modules outside any recorded call */
    PyObject *call_frame;     /* (frame, parent) -> the user frame, by the Python walk */
    PyObject *dispatcher_code, *wrapped_call, *call_impl, *inner;
    PyObject *tensor_type, *parameter_type;
    PyObject *tuple_values;   /* the Handler's: the exact types a flat tuple may hold beside tensors, or NULL */
    PyObject *bound_output;   /* bound_all of a call's result (plain objects' attributes walked too), or NULL */
    PyObject *compiler_dict;  /* vars(torch.compiler): no call is recorded while Dynamo compiles, or NULL */
    PyObject *note_other;     /* note_other_thread (capture/call_impl.py): another thread's call noted, or NULL */
    unsigned long owner;
    long user, skip_verdict, stop, boundary;  /* the frame verdicts (capture/source.py) */
    const FastReads *fast;    /* torchlens-accel's _reads (fast_reads.h), or NULL: then st.value_record reads */
} Recorder;

#define RECORDER_OBJECTS(X) \
    X(dict) X(impl) X(fallback) X(state) X(skip) X(stack) X(calls) X(call_frames) X(producers) X(verdicts) \
    X(bound_all) X(outside) X(call_frame) X(dispatcher_code) X(wrapped_call) X(call_impl) X(inner) X(tensor_type) X(parameter_type) \
    X(tuple_values) X(bound_output) X(compiler_dict) X(note_other)

/* Interned names. */
static PyObject *s_raised_in, *s_pass_through, *s_end_pass_through, *s_root, *s_root_running, *s_last_write,
    *s_value_record, *s_acting;

/* The record whose value a tensor holds, or -1 (``bound`` in capture/modules.py): the one it was last bound
 * to, unless a write was noted since that record, when ``st.value_record`` decides.  New reference. */
static PyObject *bound_index(Recorder *r, PyObject *t) {
    PyObject *key = PyLong_FromVoidPtr(t);
    if (key == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(r->producers, key);
    Py_DECREF(key);
    if (entry == NULL && PyErr_Occurred()) return NULL;
    if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) return PyLong_FromLong(-1);
    PyObject *ref = PyTuple_GET_ITEM(entry, 0);
    if (ref != t && !(PyWeakref_CheckRef(ref) && PyWeakref_GetObject(ref) == t)) return PyLong_FromLong(-1);
    PyObject *index = PyTuple_GET_ITEM(entry, 1);
    PyObject *last_write = PyObject_GetAttr(r->state, s_last_write);
    if (last_write == NULL) return NULL;
    int written = PyObject_RichCompareBool(last_write, index, Py_GT);  /* a write noted since its binding */
    Py_DECREF(last_write);
    if (written <= 0) return written < 0 ? NULL : Py_NewRef(index);
    if (r->fast != NULL) {  /* its version unmoved (a write elsewhere: a norm's running statistics): still the op's */
        PyObject *now = r->fast->version(t);
        if (now == NULL && PyErr_Occurred()) return NULL;
        int same = now != NULL ? PyObject_RichCompareBool(now, PyTuple_GET_ITEM(entry, 2), Py_EQ) : 0;
        Py_XDECREF(now);
        if (same != 0) return same < 0 ? NULL : Py_NewRef(index);
    }
    return PyObject_CallMethodOneArg(r->state, s_value_record, t);
}

static int recorded_tensor(Recorder *r, PyObject *value) {
    PyTypeObject *type = Py_TYPE(value);
    return type == (PyTypeObject *)r->tensor_type || type == (PyTypeObject *)r->parameter_type;
}

/* The bound producers of the tensors in ``items`` (a flat tuple or list of plain tensors and plain
 * values, ``hidden_states, attention_mask, None``: ``tuple_values``, where the walker finds nothing), in
 * the walker's order; NULL without an error when an item is anything else (the walker decides).  New
 * reference. */
static PyObject *bound_of_flat(Recorder *r, PyObject *items) {
    PyObject *fast = PySequence_Fast(items, "");  /* a tuple or list: itself */
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), found = 0;
    PyObject **item = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (recorded_tensor(r, item[i])) {
            found++;
            continue;
        }
        int plain = PySet_Contains(r->tuple_values, (PyObject *)Py_TYPE(item[i]));
        if (plain <= 0) {
            Py_DECREF(fast);
            return NULL;  /* with an error when the lookup failed */
        }
    }
    PyObject *result = PyTuple_New(found);
    for (Py_ssize_t i = 0, k = 0; result != NULL && i < n; i++) {
        if (!recorded_tensor(r, item[i])) continue;
        PyObject *index = bound_index(r, item[i]);
        if (index == NULL) Py_CLEAR(result);
        else PyTuple_SET_ITEM(result, k++, index);
    }
    Py_DECREF(fast);
    return result;
}

/* The bound producers of the tensors in ``value``: one plain tensor or a flat tuple or list inline,
 * anything else by ``walker`` (``bound_all`` for arguments, ``bound_output`` for a result). */
static PyObject *bound_of(Recorder *r, PyObject *value, PyObject *walker) {
    if (recorded_tensor(r, value)) {
        PyObject *index = bound_index(r, value);
        if (index == NULL) return NULL;
        PyObject *one = PyTuple_Pack(1, index);
        Py_DECREF(index);
        return one;
    }
    if (r->tuple_values != NULL && (PyTuple_CheckExact(value) || PyList_CheckExact(value))) {
        PyObject *flat = bound_of_flat(r, value);
        if (flat != NULL || PyErr_Occurred()) return flat;
    }
    return PyObject_CallOneArg(walker, value);
}

static long frame_verdict(Recorder *r, PyObject *code) {
    PyObject *key = PyLong_FromVoidPtr(code);
    if (key == NULL) return -2;
    PyObject *v = PyDict_GetItemWithError(r->verdicts, key);
    Py_DECREF(key);
    if (v == NULL) return PyErr_Occurred() ? -2 : -1;
    long verdict = PyLong_AsLong(v);
    return verdict == -1 && PyErr_Occurred() ? -2 : verdict;
}

/* The (code, offset) of the user frame making the call, when the common cases decide it: 1 with
 * ``*frame`` set (new reference), 0 for the Python record_call, -1 on error. */
/* Whether ``code`` is one of the relays' (``dispatcher_code``: the dispatcher's and the relay's code, in
 * the order a recorder meets their frames; capture/call_impl.py). */
static int is_relay(Recorder *r, PyObject *code) {
    PyObject *relays = r->dispatcher_code;
    if (!PyTuple_Check(relays)) return code == relays;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(relays); i++)
        if (PyTuple_GET_ITEM(relays, i) == code) return 1;
    return 0;
}

/* The rest of ``FrameClassifier.module_call_frame``'s walk, up from ``frame`` (a new reference, given
 * away): the first user frame, the parent call's site at a module call's boundary, or no user frame at
 * the trace driver's.  It runs for calls that torch code makes from a helper of a forward (the
 * ``_sa_block`` of ``nn.TransformerEncoderLayer``).  1 with ``*site`` set (new reference); 0 when a frame
 * has no verdict yet (the Python walk classifies it); -1 on error. */
static int walk_to_site(Recorder *r, PyFrameObject *frame, PyObject *parent, long parent_index, PyObject **site) {
    while (frame != NULL) {
        PyObject *code = (PyObject *)PyFrame_GetCode(frame);
        long verdict = frame_verdict(r, code);
        int result = 2;  /* 2: walk on */
        if (verdict == -2) {
            result = -1;
        } else if (verdict == -1) {
            result = 0;
        } else if (verdict == r->user) {
            PyObject *line = PyLong_FromLong(PyFrame_GetLasti(frame));
            *site = line ? PyTuple_Pack(2, code, line) : NULL;
            Py_XDECREF(line);
            result = *site ? 1 : -1;
        } else if (verdict == r->stop) {
            *site = PyTuple_Pack(2, Py_None, Py_None);
            result = *site ? 1 : -1;
        } else if (verdict == r->boundary && parent_index >= 0) {
            *site = PyObject_GetItem(r->call_frames, parent);
            result = *site ? 1 : -1;
        }
        Py_DECREF(code);
        if (result != 2) {
            Py_DECREF(frame);
            return result;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    *site = PyTuple_Pack(2, Py_None, Py_None);
    return *site ? 1 : -1;
}

static int call_site(Recorder *r, PyObject *parent, long parent_index, PyObject **frame) {
    PyFrameObject *wrapped = PyEval_GetFrame();  /* borrowed: record_call's caller */
    if (wrapped == NULL) return 0;
    Py_INCREF(wrapped);
    PyObject *code = (PyObject *)PyFrame_GetCode(wrapped);
    while (is_relay(r, code)) {  /* the relay and the dispatcher pass the call on: look past them */
        PyFrameObject *back = PyFrame_GetBack(wrapped);
        Py_DECREF(wrapped);
        Py_DECREF(code);
        if (back == NULL) return 0;
        wrapped = back;
        code = (PyObject *)PyFrame_GetCode(wrapped);
    }
    int is_wrapped = code == r->wrapped_call;
    Py_DECREF(code);
    if (!is_wrapped) {  /* a class's own _call_impl, or a direct call */
        Py_DECREF(wrapped);
        return 0;
    }
    PyFrameObject *caller = PyFrame_GetBack(wrapped);
    Py_DECREF(wrapped);
    if (caller == NULL) return 0;
    int result = 0;
    code = (PyObject *)PyFrame_GetCode(caller);
    long verdict = frame_verdict(r, code);
    if (verdict == -2) {
        result = -1;
    } else if (verdict == r->user) {
        PyObject *line = PyLong_FromLong(PyFrame_GetLasti(caller));
        *frame = line ? PyTuple_Pack(2, code, line) : NULL;
        Py_XDECREF(line);
        result = *frame ? 1 : -1;
    } else if (verdict == r->skip_verdict) {
        PyFrameObject *back = PyFrame_GetBack(caller);
        if (back != NULL) {
            PyObject *outer = (PyObject *)PyFrame_GetCode(back);
            if ((outer == r->call_impl || outer == r->inner) && parent_index >= 0) {
                /* Torch code run as a forward by _call_impl (nn.Sequential's): the parent call's site. */
                *frame = PyObject_GetItem(r->call_frames, parent);
                result = *frame ? 1 : -1;
            } else if (outer == r->call_impl || outer == r->inner) {
                /* ... outside any recorded call (the root nn.Sequential's): walked once per such frame. */
                if (PyList_GET_ITEM(r->outside, 0) == (PyObject *)caller) {
                    *frame = Py_NewRef(PyList_GET_ITEM(r->outside, 1));
                } else {
                    PyObject *argv[] = {(PyObject *)caller, parent};
                    *frame = PyObject_Vectorcall(r->call_frame, argv, 2, NULL);
                    if (*frame != NULL && (PyList_SetItem(r->outside, 0, Py_NewRef((PyObject *)caller)) < 0
                                           || PyList_SetItem(r->outside, 1, Py_NewRef(*frame)) < 0))
                        Py_CLEAR(*frame);
                }
                result = *frame ? 1 : -1;
            }
            Py_DECREF(outer);
            Py_DECREF(back);
        }
    }
    Py_DECREF(code);
    if (result == 0 && verdict >= 0 && r->stop >= 0)  /* any other known frame: the walk, here */
        return walk_to_site(r, caller, parent, parent_index, frame);  /* takes ``caller`` */
    Py_DECREF(caller);
    return result;
}

/* A call of a module the recorder skips (``record_call``'s first branch in capture/modules.py): the traced root's
   own call, which is the trace itself, runs with ``state.root_running`` set; the root's calls of itself inside
   it (recursion, rare) are module calls, handed to the Python recorder; a compiled submodule's run as they are. */
static PyObject *skipped_call(Recorder *r, PyObject *module, PyObject *const *argv, size_t nargsf,
                              PyObject *kwnames) {
    PyObject *root = PyObject_GetAttr(r->state, s_root);
    if (root == NULL) return NULL;
    Py_DECREF(root);  /* compared by identity alone; the state holds it */
    if (root != module) return PyObject_Vectorcall(r->impl, argv, nargsf, kwnames);
    PyObject *running = PyObject_GetAttr(r->state, s_root_running);
    if (running == NULL) return NULL;
    int inside = PyObject_IsTrue(running);
    Py_DECREF(running);
    if (inside < 0) return NULL;
    if (inside) return PyObject_Vectorcall(r->fallback, argv, nargsf, kwnames);
    /* The trace this call began in, held: a forked child tears capture down inside it (capture/forks.py). */
    PyObject *state = Py_NewRef(r->state);
    if (PyObject_SetAttr(state, s_root_running, Py_True) < 0) {
        Py_DECREF(state);
        return NULL;
    }
    PyObject *output = PyObject_Vectorcall(r->impl, argv, nargsf, kwnames);
    PyObject *type, *value, *tb;  /* ``finally``: reset, keeping the call's exception */
    PyErr_Fetch(&type, &value, &tb);
    int reset = PyObject_SetAttr(state, s_root_running, Py_False);
    Py_DECREF(state);
    if (reset < 0) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        Py_XDECREF(output);
        return NULL;
    }
    PyErr_Restore(type, value, tb);
    return output;
}

static PyObject *recorder_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Recorder *r = (Recorder *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || PyThread_get_thread_ident() != r->owner || r->stack == NULL) {  /* NULL: unbound */
        if (nargs >= 1 && r->stack != NULL && r->note_other != NULL) {
            /* Another thread's call: not recorded, but noted, as the Python record_call does. */
            PyObject *noted = PyObject_CallOneArg(r->note_other, argv[0]);
            if (noted == NULL) return NULL;
            Py_DECREF(noted);
        }
        return PyObject_Vectorcall(nargs < 1 ? r->fallback : r->impl, argv, nargsf, kwnames);
    }
    if (r->compiler_dict != NULL) {
        /* Dynamo compiling (torch.cond's branches in eager mode) runs modules on fake tensors: no calls of the
         * model's forward. */
        PyObject *compiling = PyDict_GetItemWithError(r->compiler_dict, s_is_compiling);
        if (compiling == NULL && PyErr_Occurred()) return NULL;
        if (compiling != NULL && compiling != Py_False) {
            int on = PyObject_IsTrue(compiling);
            if (on < 0) return NULL;
            if (on) return PyObject_Vectorcall(r->impl, argv, nargsf, kwnames);
        }
    }
    PyObject *module = argv[0];
    PyObject *key = PyLong_FromVoidPtr(module);
    if (key == NULL) return NULL;
    int skipped = PySet_Contains(r->skip, key);
    Py_DECREF(key);
    if (skipped < 0) return NULL;
    if (skipped) return skipped_call(r, module, argv, nargsf, kwnames);
    /* An intervention's action running (intervene/runtime.py): the module calls it makes are none of the forward's. */
    PyObject *acting = PyObject_GetAttr(r->state, s_acting);
    if (acting == NULL) return NULL;
    int in_action = acting != Py_False && PyObject_IsTrue(acting);
    Py_DECREF(acting);
    if (in_action < 0) return NULL;
    if (in_action) return PyObject_Vectorcall(r->impl, argv, nargsf, kwnames);
    Py_ssize_t depth = PyList_GET_SIZE(r->stack);
    PyObject *parent = depth ? Py_NewRef(PyList_GET_ITEM(r->stack, depth - 1)) : PyLong_FromLong(-1);
    if (parent == NULL) return NULL;
    long parent_index = PyLong_AsLong(parent);
    if (parent_index == -1 && PyErr_Occurred()) {
        Py_DECREF(parent);
        return NULL;
    }
    PyObject *frame = NULL;
    int decided = call_site(r, parent, parent_index, &frame);
    if (decided <= 0) {
        Py_DECREF(parent);
        return decided < 0 ? NULL : PyObject_Vectorcall(r->fallback, argv, nargsf, kwnames);
    }
    PyObject *result = NULL, *call = NULL, *index = NULL, *t0 = NULL, *inputs = NULL;
    /* ``args`` as record_call sees them: the positional arguments after the module, then the keyword ones. */
    if (nargs == 2) {
        inputs = bound_of(r, argv[1], r->bound_all);
    } else {
        PyObject *positional = PyTuple_New(nargs - 1);
        if (positional != NULL) {
            for (Py_ssize_t i = 1; i < nargs; i++) PyTuple_SET_ITEM(positional, i - 1, Py_NewRef(argv[i]));
            inputs = bound_of(r, positional, r->bound_all);
            Py_DECREF(positional);
        }
    }
    if (inputs != NULL && kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        /* Then the keyword arguments' tensors, in the order they were passed. */
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        PyObject *values = PyTuple_New(nk), *more = NULL, *all = NULL;
        if (values != NULL) {
            for (Py_ssize_t i = 0; i < nk; i++) PyTuple_SET_ITEM(values, i, Py_NewRef(argv[nargs + i]));
            more = bound_of(r, values, r->bound_all);
            Py_DECREF(values);
        }
        all = more != NULL ? PySequence_Concat(inputs, more) : NULL;
        Py_XDECREF(more);
        Py_DECREF(inputs);
        inputs = all;
    }
    if (inputs == NULL) goto done;
    index = PyLong_FromSsize_t(PyList_GET_SIZE(r->calls));
    t0 = index ? now_ns() : NULL;
    call = t0 ? PyList_New(6) : NULL;
    if (call == NULL) goto done;
    PyObject *fields[6] = {module, parent, t0, Py_None, inputs, empty_tuple};
    for (int i = 0; i < 6; i++) PyList_SET_ITEM(call, i, Py_NewRef(fields[i]));
    if (PyList_Append(r->call_frames, frame) < 0) goto done;
    if (PyList_Append(r->calls, call) < 0 || PyList_Append(r->stack, index) < 0) goto done;
    PyObject *output = PyObject_Vectorcall(r->impl, argv, nargsf, kwnames);
    if (output == NULL) {
        /* The innermost call an exception left: ``st.raised_in = (exception, index)``. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        /* It returned nothing: outputs of None, where a call returning None has () (capture/caught.py). */
        PyObject *outputs = PyList_GET_ITEM(call, 5);
        if (PyTuple_Check(outputs) && PyTuple_GET_SIZE(outputs) == 0) PyList_SetItem(call, 5, Py_NewRef(Py_None));
        PyObject *raised_in = PyObject_GetAttr(r->state, s_raised_in);
        int fresh = raised_in != NULL && (raised_in == Py_None || !PyTuple_Check(raised_in)
                                         || PyTuple_GET_SIZE(raised_in) < 1 || PyTuple_GET_ITEM(raised_in, 0) != value);
        Py_XDECREF(raised_in);
        PyObject *pair = fresh ? PyTuple_Pack(2, value, index) : NULL;
        int noted = raised_in != NULL && (!fresh || (pair != NULL && PyObject_SetAttr(r->state, s_raised_in, pair) == 0));
        Py_XDECREF(pair);
        if (noted) {
            PyErr_Restore(type, value, tb);
        } else {  /* failed noting it: that error, with the call's as its context */
            PyObject *type2, *value2, *tb2;
            PyErr_Fetch(&type2, &value2, &tb2);
            PyErr_NormalizeException(&type2, &value2, &tb2);
            PyException_SetContext(value2, value);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            PyErr_Restore(type2, value2, tb2);
        }
    }
    /* ``finally``: the end time and the pop, whatever happened. */
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *t1 = now_ns();
        int failed = t1 == NULL || PyList_SetItem(call, 3, t1) < 0;  /* steals t1 */
        Py_ssize_t n = PyList_GET_SIZE(r->stack);
        failed = failed || n == 0 || PyList_SetSlice(r->stack, n - 1, n, NULL) < 0;
        if (failed && output != NULL) {
            Py_CLEAR(output);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchlens: the module call stack is empty");
            goto done;
        }
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    if (output == NULL) goto done;
    if (output != Py_None) {
        PyObject *outputs = bound_of(r, output, r->bound_output != NULL ? r->bound_output : r->bound_all);
        if (outputs == NULL || PyList_SetItem(call, 5, outputs) < 0) {
            Py_DECREF(output);
            goto done;
        }
    }
    {  /* An op in it returned its argument itself: ``st.end_pass_through``, as the Python recorder does. */
        PyObject *pending = PyObject_GetAttr(r->state, s_pass_through);
        if (pending == NULL) {
            Py_DECREF(output);
            goto done;
        }
        if (pending != Py_None) {
            PyObject *ended = PyObject_CallMethodObjArgs(r->state, s_end_pass_through, index, parent,
                                                         PyList_GET_ITEM(call, 5), NULL);
            Py_XDECREF(ended);
            if (ended == NULL) {
                Py_DECREF(pending);
                Py_DECREF(output);
                goto done;
            }
        }
        Py_DECREF(pending);
    }
    result = output;
done:
    Py_DECREF(parent);
    Py_DECREF(frame);
    Py_XDECREF(inputs);
    Py_XDECREF(index);
    Py_XDECREF(t0);
    Py_XDECREF(call);
    return result;
}

static int recorder_traverse(Recorder *r, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(r->name);
    RECORDER_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int recorder_clear(Recorder *r) {
#define CLEAR(name) Py_CLEAR(r->name);
    RECORDER_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void recorder_dealloc(Recorder *r) {
    PyObject_GC_UnTrack(r);
    recorder_clear(r);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *recorder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"impl", "fallback", "state", "owner", "skip", "stack", "calls", "call_frames",
                            "producers", "verdicts", "bound_all", "outside", "call_frame", "dispatcher_code", "wrapped_call", "call_impl",
                            "inner", "tensor_type", "parameter_type", "user", "skip_verdict", "stop", "boundary",
                            "tuple_values", "bound_output", "compiler_dict", "fast_reads", "note_other", NULL};
    PyObject *fast_reads = Py_None;
    Recorder *r = (Recorder *)type->tp_alloc(type, 0);
    if (r == NULL) return NULL;
    r->stop = r->boundary = -1;  /* not given: every other call site is the Python walk's */
    /* tuple_values not given: every container is the walker's */
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOkO!O!O!O!O!O!OO!OOOOOO!O!ll|llO!OO!OO:ModuleRecorder", names, &r->impl, &r->fallback, &r->state,
            &r->owner, &PySet_Type, &r->skip, &PyList_Type, &r->stack, &PyList_Type, &r->calls, &PyList_Type,
            &r->call_frames, &PyDict_Type, &r->producers, &PyDict_Type, &r->verdicts, &r->bound_all, &PyList_Type, &r->outside, &r->call_frame,
            &r->dispatcher_code, &r->wrapped_call, &r->call_impl, &r->inner, &PyType_Type, &r->tensor_type,
            &PyType_Type, &r->parameter_type, &r->user, &r->skip_verdict, &r->stop, &r->boundary,
            &PyFrozenSet_Type, &r->tuple_values, &r->bound_output, &PyDict_Type, &r->compiler_dict, &fast_reads,
            &r->note_other)) {
        memset(&r->dict, 0, offsetof(Recorder, owner) - offsetof(Recorder, dict));
        Py_DECREF(r);
        return NULL;
    }
#define HOLD(name) Py_XINCREF(r->name);
    RECORDER_OBJECTS(HOLD)
#undef HOLD
    if (PyList_GET_SIZE(r->outside) != 2) {
        PyErr_SetString(PyExc_ValueError, "ModuleRecorder: outside must be a [frame, answer] list");
        Py_DECREF(r);
        return NULL;
    }
    if (fast_reads_of(fast_reads, "ModuleRecorder", &r->fast) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->vectorcall = recorder_vectorcall;
    return (PyObject *)r;
}

/* ``bind(state, skip, stack, calls, call_frames, producers)``: record into another trace's lists from now
 * on; ``bind()``: into none (every call goes straight to ``impl``).  A recorder is kept per thread, bound
 * at each trace's start and unbound at its end, so that it holds no trace's records in between: building
 * one takes twenty-one arguments, binding six. */
static PyObject *recorder_bind(Recorder *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs == 0) {
        Py_CLEAR(r->skip);
        Py_CLEAR(r->stack);
        Py_CLEAR(r->calls);
        Py_CLEAR(r->call_frames);
        Py_CLEAR(r->producers);
        Py_SETREF(r->state, Py_NewRef(Py_None));
        Py_RETURN_NONE;
    }
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "ModuleRecorder.bind(state, skip, stack, calls, call_frames, producers) "
                                         "takes six arguments, or none");
        return NULL;
    }
    PyTypeObject *types[6] = {NULL, &PySet_Type, &PyList_Type, &PyList_Type, &PyList_Type, &PyDict_Type};
    for (int i = 1; i < 6; i++) {
        if (!Py_IS_TYPE(args[i], types[i])) {
            PyErr_Format(PyExc_TypeError, "ModuleRecorder.bind: argument %d must be a %s", i + 1, types[i]->tp_name);
            return NULL;
        }
    }
    Py_SETREF(r->state, Py_NewRef(args[0]));
    Py_XSETREF(r->skip, Py_NewRef(args[1]));
    Py_XSETREF(r->stack, Py_NewRef(args[2]));
    Py_XSETREF(r->calls, Py_NewRef(args[3]));
    Py_XSETREF(r->call_frames, Py_NewRef(args[4]));
    Py_XSETREF(r->producers, Py_NewRef(args[5]));
    Py_RETURN_NONE;
}

static PyMethodDef recorder_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))recorder_bind, METH_FASTCALL,
     "bind(state, skip, stack, calls, call_frames, producers): record into these from now on; bind(): into none."},
    {NULL},
};

static PyObject *recorder_get(PyObject *self, PyObject *obj, PyObject *type) {
    /* Looked up on a module, it binds to it, as the function it replaces would. */
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._capture.ModuleRecorder",
    .tp_doc = "ModuleCallTracker's record_call for the common module call, compiled.",
    .tp_basicsize = sizeof(Recorder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = recorder_new,
    .tp_dealloc = (destructor)recorder_dealloc,
    .tp_traverse = (traverseproc)recorder_traverse,
    .tp_clear = (inquiry)recorder_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Recorder, vectorcall),
    .tp_descr_get = recorder_get,
    .tp_methods = recorder_methods,
    .tp_dictoffset = offsetof(Recorder, dict),
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;

int add_module_recorder(PyObject *m) {
    INTERN(s_raised_in, "raised_in") INTERN(s_pass_through, "pass_through") INTERN(s_end_pass_through, "end_pass_through")
    INTERN(s_root, "root") INTERN(s_root_running, "root_running") INTERN(s_last_write, "last_write")
    INTERN(s_value_record, "value_record") INTERN(s_acting, "acting")
    if (PyType_Ready(&RecorderType) < 0) return -1;
    return PyModule_AddObjectRef(m, "ModuleRecorder", (PyObject *)&RecorderType);
}
