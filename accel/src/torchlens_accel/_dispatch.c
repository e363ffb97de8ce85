/* The body of capture's ``handle_torch_function``, compiled: see torchlens/capture/dispatch.py, whose
 * Python function ``Dispatcher`` stands in for with the same checks in the same order.  While a trace runs,
 * torch's Python-level functions (F.relu, F.layer_norm) find dispatch.py's ``handle_torch_function_compiled``
 * in place of torch's own, a Python frame (the call sites the capture handler reads off the frames are the
 * ones torch's own gives) that hands its arguments here.  It answers the capturing thread's common call
 * (its capture mode alone on the mode stack, every relevant argument a plain tensor, a Parameter or None)
 * by calling the mode with the mode lifted off the stack, exactly as torch does, and hands every other
 * call to torch's own, whole.  Everything it needs is handed over at construction: this file imports
 * nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

/* Bumped whenever what Python hands over changes, with torchlens.capture.accel.ABI. */
#define TORCHLENS_ACCEL_ABI 1

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *capturing;      /* the threading.local whose ``mode`` is the calling thread's capture mode */
    PyObject *torch_own;      /* torch.overrides.handle_torch_function */
    PyObject *tensor_type;
    PyObject *parameter_type; /* Parameter when torch leaves it out of the types, else None */
    PyObject *tensor_types;   /* (Tensor,): the types when a plain tensor is among the relevant arguments */
    PyObject *stack_len, *stack_at, *stack_pop, *stack_push, *mode_enabled; /* torch._C's mode stack */
    PyObject *overloads;      /* _overloads(public_api, types, args, kwargs): after a NotImplemented */
} Dispatcher;

static PyObject *s_mode, *s_torch_function, *zero;  /* interned names, and the stack index of the bottom mode */

/* 1 when the calling thread's capture mode ``mode`` is the only mode on the stack and modes are on. */
static int alone_on_stack(Dispatcher *d, PyObject *mode) {
    PyObject *depth = PyObject_CallNoArgs(d->stack_len);
    if (depth == NULL) return -1;
    long n = PyLong_AsLong(depth);
    Py_DECREF(depth);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n != 1) return 0;
    PyObject *top = PyObject_CallOneArg(d->stack_at, zero);
    if (top == NULL) return -1;
    Py_DECREF(top);  /* the stack still holds it */
    if (top != mode) return 0;
    PyObject *enabled = PyObject_CallNoArgs(d->mode_enabled);
    if (enabled == NULL) return -1;
    int on = PyObject_IsTrue(enabled);
    Py_DECREF(enabled);
    return on;
}

/* The types torch would pass (a new reference), or NULL without an error when an argument is not plain
 * (with one, should the empty tuple fail). */
static PyObject *plain_types(Dispatcher *d, PyObject *relevant) {
    PyObject *types = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(relevant); i++) {
        PyObject *arg = PyTuple_GET_ITEM(relevant, i);
        PyObject *kind = (PyObject *)Py_TYPE(arg);
        if (kind == d->tensor_type) {
            types = d->tensor_types;
        } else if (arg != Py_None && kind != d->parameter_type) {
            return NULL;  /* a subclass or another value: torch's own decides */
        }
    }
    return types != NULL ? Py_NewRef(types) : PyTuple_New(0);
}

static PyObject *call_mode(Dispatcher *d, PyObject *mode, PyObject *public_api, PyObject *types, PyObject *args,
                           PyObject *kwargs) {
    PyObject *handler = PyObject_GetAttr(mode, s_torch_function);
    if (handler == NULL) return NULL;
    PyObject *popped = PyObject_CallNoArgs(d->stack_pop);
    if (popped == NULL) {
        Py_DECREF(handler);
        return NULL;
    }
    Py_DECREF(popped);
    PyObject *call[4] = {public_api, types, args, kwargs};
    PyObject *result = PyObject_Vectorcall(handler, call, 4, NULL);
    Py_DECREF(handler);
    /* The mode goes back whatever happened, the error (an interrupt included) kept. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *pushed = PyObject_CallOneArg(d->stack_push, mode);
    if (pushed == NULL) {
        Py_CLEAR(result);
        if (type != NULL) {
            PyErr_Clear();
            PyErr_Restore(type, value, traceback);
        }
    } else {
        Py_DECREF(pushed);
        PyErr_Restore(type, value, traceback);
    }
    if (result == Py_NotImplemented) {  /* never from the capture mode: what torch's own does next */
        Py_DECREF(result);
        result = PyObject_Vectorcall(d->overloads, call, 4, NULL);
    }
    return result;
}

/* torch's own, called as its callers call it: (public_api, relevant_args, *args, **kwargs). */
static PyObject *torch_own(Dispatcher *d, PyObject *public_api, PyObject *relevant, PyObject *args, PyObject *kwargs) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *all = PyTuple_New(n + 2);
    if (all == NULL) return NULL;
    PyTuple_SET_ITEM(all, 0, Py_NewRef(public_api));
    PyTuple_SET_ITEM(all, 1, Py_NewRef(relevant));
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(all, i + 2, Py_NewRef(PyTuple_GET_ITEM(args, i)));
    PyObject *result = PyObject_Call(d->torch_own, all, kwargs);
    Py_DECREF(all);
    return result;
}

/* answer(public_api, relevant_args, args, kwargs): the body of dispatch.py's handle_torch_function. */
static PyObject *dispatcher_vectorcall(PyObject *self, PyObject *const *argv, size_t nargsf, PyObject *kwnames) {
    Dispatcher *d = (Dispatcher *)self;
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL || !PyTuple_CheckExact(argv[2])
            || !PyDict_CheckExact(argv[3])) {
        PyErr_SetString(PyExc_TypeError, "Dispatcher takes (public_api, relevant_args, args tuple, kwargs dict)");
        return NULL;
    }
    PyObject *public_api = argv[0], *relevant = argv[1], *args = argv[2], *kwargs = argv[3];
    if (PyTuple_CheckExact(relevant)) {
        PyObject *mode = PyObject_GetAttr(d->capturing, s_mode);
        if (mode == NULL) return NULL;
        if (mode != Py_None) {
            int alone = alone_on_stack(d, mode);
            PyObject *types = alone > 0 ? plain_types(d, relevant) : NULL;
            if (types != NULL) {
                PyObject *result = call_mode(d, mode, public_api, types, args, kwargs);
                Py_DECREF(types);
                Py_DECREF(mode);
                return result;
            }
            if (alone < 0 || PyErr_Occurred()) {
                Py_DECREF(mode);
                return NULL;
            }
        }
        Py_DECREF(mode);
    }
    return torch_own(d, public_api, relevant, args, kwargs);
}

static int dispatcher_traverse(Dispatcher *d, visitproc visit, void *arg) {
    Py_VISIT(d->capturing);
    Py_VISIT(d->torch_own);
    Py_VISIT(d->tensor_type);
    Py_VISIT(d->parameter_type);
    Py_VISIT(d->tensor_types);
    Py_VISIT(d->stack_len);
    Py_VISIT(d->stack_at);
    Py_VISIT(d->stack_pop);
    Py_VISIT(d->stack_push);
    Py_VISIT(d->mode_enabled);
    Py_VISIT(d->overloads);
    return 0;
}

static int dispatcher_clear(Dispatcher *d) {
    Py_CLEAR(d->capturing);
    Py_CLEAR(d->torch_own);
    Py_CLEAR(d->tensor_type);
    Py_CLEAR(d->parameter_type);
    Py_CLEAR(d->tensor_types);
    Py_CLEAR(d->stack_len);
    Py_CLEAR(d->stack_at);
    Py_CLEAR(d->stack_pop);
    Py_CLEAR(d->stack_push);
    Py_CLEAR(d->mode_enabled);
    Py_CLEAR(d->overloads);
    return 0;
}

static void dispatcher_dealloc(Dispatcher *d) {
    PyObject_GC_UnTrack(d);
    dispatcher_clear(d);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyObject *dispatcher_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"capturing", "torch_own", "tensor_type", "parameter_type", "tensor_types",
                            "stack_len", "stack_at", "stack_pop", "stack_push", "mode_enabled", "overloads", NULL};
    PyObject *v[11];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO!OOOOOO", names, &v[0], &v[1], &v[2], &v[3],
                                     &PyTuple_Type, &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10]))
        return NULL;
    Dispatcher *d = (Dispatcher *)type->tp_alloc(type, 0);
    if (d == NULL) return NULL;
    d->vectorcall = dispatcher_vectorcall;
    PyObject **fields[11] = {&d->capturing, &d->torch_own, &d->tensor_type, &d->parameter_type, &d->tensor_types,
                             &d->stack_len, &d->stack_at, &d->stack_pop, &d->stack_push, &d->mode_enabled,
                             &d->overloads};
    for (int i = 0; i < 11; i++) *fields[i] = Py_NewRef(v[i]);
    return (PyObject *)d;
}

static PyTypeObject DispatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._dispatch.Dispatcher",
    .tp_doc = "torchlens.capture.dispatch.handle_torch_function, compiled.",
    .tp_basicsize = sizeof(Dispatcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = dispatcher_new,
    .tp_dealloc = (destructor)dispatcher_dealloc,
    .tp_traverse = (traverseproc)dispatcher_traverse,
    .tp_clear = (inquiry)dispatcher_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Dispatcher, vectorcall),
};

/* swap(namespaces, name, expected, replacement): in each dict of the tuple ``namespaces`` whose ``name`` is
 * one of the tuple ``expected`` (by identity), put ``replacement`` (dispatch.install and uninstall, which
 * every trace runs). */
static PyObject *swap(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || !PyUnicode_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "swap(namespaces tuple, name, expected tuple, replacement)");
        return NULL;
    }
    PyObject *namespaces = args[0], *name = args[1], *expected = args[2], *replacement = args[3];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(namespaces); i++) {
        PyObject *namespace = PyTuple_GET_ITEM(namespaces, i);
        if (!PyDict_Check(namespace)) {
            PyErr_SetString(PyExc_TypeError, "swap: the namespaces must be dicts");
            return NULL;
        }
        PyObject *current = PyDict_GetItemWithError(namespace, name);  /* borrowed */
        if (current == NULL) {
            if (PyErr_Occurred()) return NULL;
            continue;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(expected); j++) {
            if (current == PyTuple_GET_ITEM(expected, j)) {
                if (PyDict_SetItem(namespace, name, replacement) < 0) return NULL;
                break;
            }
        }
    }
    Py_RETURN_NONE;
}

static PyMethodDef dispatch_functions[] = {
    {"swap", (PyCFunction)(void (*)(void))swap, METH_FASTCALL,
     "swap(namespaces, name, expected, replacement): put replacement where name holds one of expected."},
    {NULL},
};

static struct PyModuleDef dispatch_module = {
    PyModuleDef_HEAD_INIT, "_dispatch", "torchlens's handle_torch_function for a trace, compiled.", -1,
    dispatch_functions,
};

PyMODINIT_FUNC PyInit__dispatch(void) {
    if ((s_mode = PyUnicode_InternFromString("mode")) == NULL
            || (s_torch_function = PyUnicode_InternFromString("__torch_function__")) == NULL
            || (zero = PyLong_FromLong(0)) == NULL || PyType_Ready(&DispatcherType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&dispatch_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0
            || PyModule_AddObjectRef(m, "Dispatcher", (PyObject *)&DispatcherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
