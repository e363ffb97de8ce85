/* Gradient capture's tensor hooks, compiled: see torchlens/capture/grads.py, whose pure-Python path
 * this follows step for step.
 *
 * Sink       what the hooks write into: gradients by record index, their arrival order, the backwards
 *            that delivered them (the Python path's _Sink).
 * Hook       the tensor hook of one record: Hook(sink, index)(grad) is _store(sink, index, grad).
 * HookAdder  add_hook(index, t, func=None, module_call=-1) for plain tensors, taking the steps of
 *            Tensor.register_hook itself; any other call (a tensor subclass) goes to the Python fallback.
 *            It owns the capture's hooks: deleting it removes them.
 * remove_hooks(handles, keys, base)  the Python path's _remove_all.
 *
 * Hooks are called by autograd once per op per backward and added once per op per forward, so both
 * are C callables with vectorcall: no Python frame on either path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Bumped with torchlens.capture.accel.ABI whenever what is built here changes meaning. */
#define TORCHLENS_ACCEL_ABI 5

static PyObject *str_requires_grad, *str_detach, *str_grad_fn, *str_backward_hooks, *str_register_hook_dict,
    *str_sequence_nr, *str_release;

/* ----- Sink ---------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    PyObject *grads;   /* record index -> accumulated gradient (detached; never written in place) */
    PyObject *order;   /* record indices in the order their first gradient arrived (a list) */
    Py_ssize_t backwards;
    PyObject *task;    /* the graph task delivering gradients here, until it ends; NULL between backwards */
    PyObject *task_id; /* torch._C._current_graph_task_id, or a stand-in returning None */
    PyObject *on_backward; /* called with the sink when a backward delivers its first gradient, or None */
    PyObject *guarded; /* a frozenset of leaves counted only in a backward that reached another record first */
    PyObject *held;     /* guarded leaf -> gradient from a backward run inside ``held_for`` (a dict, or NULL) */
    PyObject *held_for; /* the backward ``held`` waits for, or NULL */
} Sink;

static PyObject *sink_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *task_id, *on_backward = Py_None;
    static char *kwlist[] = {"task_id", "on_backward", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:Sink", kwlist, &task_id, &on_backward)) return NULL;
    Sink *self = (Sink *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->grads = PyDict_New();
    self->order = PyList_New(0);
    if (self->grads == NULL || self->order == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(task_id);
    self->task_id = task_id;
    Py_INCREF(on_backward);
    self->on_backward = on_backward;
    return (PyObject *)self;
}

static int sink_traverse(Sink *self, visitproc visit, void *arg) {
    Py_VISIT(self->grads);
    Py_VISIT(self->order);
    Py_VISIT(self->task);
    Py_VISIT(self->task_id);
    Py_VISIT(self->on_backward);
    Py_VISIT(self->guarded);
    Py_VISIT(self->held);
    Py_VISIT(self->held_for);
    return 0;
}

static int sink_clear(Sink *self) {
    Py_CLEAR(self->grads);
    Py_CLEAR(self->order);
    Py_CLEAR(self->task);
    Py_CLEAR(self->task_id);
    Py_CLEAR(self->on_backward);
    Py_CLEAR(self->guarded);
    Py_CLEAR(self->held);
    Py_CLEAR(self->held_for);
    return 0;
}

static void sink_dealloc(Sink *self) {
    PyObject_GC_UnTrack(self);
    sink_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *sink_get_order(Sink *self, void *closure) {
    Py_INCREF(self->order);
    return self->order;
}

static int sink_set_order(Sink *self, PyObject *value, void *closure) {
    if (value == NULL || !PyList_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "Sink.order must be a list");
        return -1;
    }
    Py_INCREF(value);
    Py_SETREF(self->order, value);
    return 0;
}

/* grads.py's ``_Sink.guard``: the records whose gradients count only in a backward that has already
 * delivered a gradient here. */
static PyObject *sink_guard(Sink *self, PyObject *indices) {
    PyObject *guarded = PyFrozenSet_New(indices);
    if (guarded == NULL) return NULL;
    Py_XSETREF(self->guarded, guarded);
    Py_RETURN_NONE;
}

static int accumulate(PyObject *grads, PyObject *index, PyObject *grad, PyObject *order);

/* grads.py's ``_Sink.settle``: the backward ``task`` ended: add the leaf gradients held for it; no backward of
 * the trace runs now, until the next delivers. */
static PyObject *sink_settle(Sink *self, PyObject *task) {
    if (self->task != NULL) {
        int same = PyObject_RichCompareBool(self->task, task, Py_EQ);
        if (same < 0) return NULL;
        if (same) Py_CLEAR(self->task);
    }
    if (self->held_for == NULL) Py_RETURN_NONE;
    int same = PyObject_RichCompareBool(self->held_for, task, Py_EQ);
    if (same < 0) return NULL;
    if (!same) Py_RETURN_NONE; /* (held for a backward still running that this one ran inside) */
    PyObject *held = self->held;
    self->held = NULL;
    Py_CLEAR(self->held_for);
    PyObject *index, *grad;
    Py_ssize_t pos = 0;
    int rc = 0;
    while (rc == 0 && PyDict_Next(held, &pos, &index, &grad)) rc = accumulate(self->grads, index, grad, self->order);
    Py_DECREF(held);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef sink_methods[] = {
    {"guard", (PyCFunction)sink_guard, METH_O, "guard(indices): leaves counted only in a backward that reached "
     "another record first."},
    {"settle", (PyCFunction)sink_settle, METH_O, "settle(task): the backward task ended: add the leaf gradients "
     "held for it."},
    {NULL},
};

static PyMemberDef sink_members[] = {
    {"grads", T_OBJECT_EX, offsetof(Sink, grads), READONLY, "record index -> accumulated gradient"},
    {"backwards", T_PYSSIZET, offsetof(Sink, backwards), 0, "how many backwards delivered a gradient"},
    {NULL},
};

static PyGetSetDef sink_getset[] = {
    {"order", (getter)sink_get_order, (setter)sink_set_order, "record indices in backward order", NULL},
    {NULL},
};

static PyTypeObject SinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._grads.Sink",
    .tp_doc = "What the gradient hooks write into: Sink(task_id, on_backward=None).",
    .tp_basicsize = sizeof(Sink),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = sink_new,
    .tp_traverse = (traverseproc)sink_traverse,
    .tp_clear = (inquiry)sink_clear,
    .tp_dealloc = (destructor)sink_dealloc,
    .tp_methods = sink_methods,
    .tp_members = sink_members,
    .tp_getset = sink_getset,
};

/* ----- Hook ---------------------------------------------------------------------------------- */
/* Not tracked by the collector: it holds only the sink, whose gradients never lead back to a hook,
 * and one is made per op (a tracked object per op would also bring the collector round more often). */
typedef struct {
    PyObject_HEAD
    Sink *sink;
    PyObject *index; /* the record index, an int */
    vectorcallfunc vectorcall;
} Hook;

/* Add ``grad`` to the gradient kept for ``index`` in ``grads``; ``order``, when not NULL, lists each index as it
 * first arrives.  Kept by reference, not copied: autograd accumulates into a gradient buffer in place only
 * while nothing else holds it (it checks the reference count), so holding it is enough. */
static int accumulate(PyObject *grads, PyObject *index, PyObject *grad, PyObject *order) {
    PyObject *kept = PyDict_GetItemWithError(grads, index);
    if (kept == NULL) {
        int rc = PyErr_Occurred() ? -1 : PyDict_SetItem(grads, index, grad);
        return rc == 0 && order != NULL ? PyList_Append(order, index) : rc;
    }
    Py_INCREF(kept);
    PyObject *sum = PyNumber_Add(kept, grad);
    Py_DECREF(kept);
    int rc = sum == NULL ? -1 : PyDict_SetItem(grads, index, sum);
    Py_XDECREF(sum);
    return rc;
}

/* grads.py's ``_hold``: a guarded leaf reached by a backward that reached no other record here is dropped
 * between the trace's backwards (a later forward's), and held while one runs (a backward run inside it, as a
 * reentrant checkpoint runs one), to be added when it ends.  ``grad`` is detached already. */
static int hold(Sink *sink, PyObject *index, PyObject *grad) {
    if (sink->task == NULL) return 0;
    int same = sink->held_for == NULL ? 0 : PyObject_RichCompareBool(sink->held_for, sink->task, Py_EQ);
    if (same < 0) return -1;
    if (!same) { /* what is held for a backward that never ended (it raised) is dropped */
        PyObject *held = PyDict_New();
        if (held == NULL) return -1;
        Py_XSETREF(sink->held, held);
        Py_INCREF(sink->task);
        Py_XSETREF(sink->held_for, sink->task);
    }
    return accumulate(sink->held, index, grad, NULL);
}

/* Add ``grad`` to the gradient kept for the record; never alters it (grads.py's _store). */
static int store(Sink *sink, PyObject *index, PyObject *grad) {
    if (grad == Py_None) return 0; /* an output this backward did not reach (a multi-output op's other) */
    PyObject *task = PyObject_CallNoArgs(sink->task_id);
    if (task == NULL) return -1;
    int differs = sink->task == NULL ? 1 : PyObject_RichCompareBool(task, sink->task, Py_NE);
    if (differs < 0) {
        Py_DECREF(task);
        return -1;
    }
    /* a leaf reached by a backward that reached nothing else here: held (``hold``) */
    int leaf = differs && sink->guarded != NULL ? PySet_Contains(sink->guarded, index) : 0;
    if (differs && leaf == 0) {
        Py_XSETREF(sink->task, task);
        sink->backwards++;
        if (sink->on_backward != Py_None) { /* grads.py's _unshare_when_done */
            PyObject *done = PyObject_CallOneArg(sink->on_backward, (PyObject *)sink);
            if (done == NULL) return -1;
            Py_DECREF(done);
        }
    } else {
        Py_DECREF(task);
        if (leaf < 0) return -1;
    }
    PyObject *requires_grad = PyObject_GetAttr(grad, str_requires_grad);
    if (requires_grad == NULL) return -1;
    int graph = PyObject_IsTrue(requires_grad);
    Py_DECREF(requires_grad);
    if (graph < 0) return -1;
    Py_INCREF(grad);
    if (graph) { /* a backward with create_graph=True: keep the value, not a graph */
        Py_SETREF(grad, PyObject_CallMethodNoArgs(grad, str_detach));
        if (grad == NULL) return -1;
    }
    int rc = leaf ? hold(sink, index, grad) : accumulate(sink->grads, index, grad, sink->order);
    Py_DECREF(grad);
    return rc;
}

static PyObject *hook_vectorcall(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a gradient hook takes one argument, the gradient");
        return NULL;
    }
    if (store(self->sink, self->index, args[0]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *make_hook(Sink *sink, PyObject *index);

static PyObject *hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *sink, *index;
    static char *kwlist[] = {"sink", "index", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!:Hook", kwlist, &SinkType, &sink, &PyLong_Type, &index))
        return NULL;
    return make_hook((Sink *)sink, index);
}

static void hook_dealloc(Hook *self) {
    Py_DECREF(self->sink);
    Py_DECREF(self->index);
    PyObject_Free(self);
}

static PyObject *hook_repr(Hook *self) {
    return PyUnicode_FromFormat("<torchlens gradient hook of record %R>", self->index);
}

static PyMemberDef hook_members[] = {
    {"index", T_OBJECT_EX, offsetof(Hook, index), READONLY, "the record index"},
    {NULL},
};

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._grads.Hook",
    .tp_doc = "Hook(sink, index): the tensor hook keeping record index's gradient in sink.",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = hook_new,
    .tp_dealloc = (destructor)hook_dealloc,
    .tp_repr = (reprfunc)hook_repr,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Hook, vectorcall),
    .tp_members = hook_members,
};

static PyObject *make_hook(Sink *sink, PyObject *index) {
    Hook *hook = PyObject_New(Hook, &HookType);
    if (hook == NULL) return NULL;
    Py_INCREF(sink);
    Py_INCREF(index);
    hook->sink = sink;
    hook->index = index;
    hook->vectorcall = (vectorcallfunc)hook_vectorcall;
    return (PyObject *)hook;
}

/* ----- removing hooks ------------------------------------------------------------------------ */
/* A hook dict emptied by a removal: a leaf's that the capture made (grads.py's LeafHooks, the only hook dict
 * that is not exactly an OrderedDict) is taken off its leaf by its ``release``. */
static int release_if_leaf_dict(PyObject *hooks) {
    if (PyDict_GET_SIZE(hooks) != 0 || PyODict_CheckExact(hooks)) return 0;
    PyObject *release = PyObject_GetAttr(hooks, str_release);
    if (release == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear(); /* another library's dict */
        return 0;
    }
    PyObject *r = PyObject_CallNoArgs(release);
    Py_DECREF(release);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Remove every hook named in ``handles`` (record index -> weakref to its hook dict; its key is
 * keys[index] where a subclass's register_hook chose it, else base - index), then clear ``handles``:
 * grads.py's _remove_all. */
static int remove_all(PyObject *handles, PyObject *keys, long long base) {
    /* Iterated in place: nothing below can change ``handles`` (only its owner does), and deleting a hook
     * frees only the hook and its key (the sink it holds outlives this loop: its capture holds it). */
    Py_ssize_t pos = 0;
    PyObject *index, *ref;
    while (PyDict_Next(handles, &pos, &index, &ref)) {
        if (!PyWeakref_Check(ref)) continue;
        PyObject *hooks;
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(ref, &hooks) < 0) return -1;
        if (hooks == NULL) continue; /* the tensor and its hooks are gone */
#else
        hooks = PyWeakref_GetObject(ref); /* borrowed */
        if (hooks == NULL) return -1;
        if (hooks == Py_None) continue; /* the tensor and its hooks are gone */
        Py_INCREF(hooks);
#endif
        PyObject *key = PyDict_GetItemWithError(keys, index);
        if (key != NULL) {
            Py_INCREF(key);
        } else if (!PyErr_Occurred()) {
            long long i = PyLong_AsLongLong(index);
            key = i == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(base - i);
        }
        int rc = key == NULL ? -1 : PyObject_DelItem(hooks, key);
        Py_XDECREF(key);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear(); /* already gone: pop(key, None) */
            rc = 0;
        }
        if (rc == 0) rc = release_if_leaf_dict(hooks);
        Py_DECREF(hooks);
        if (rc < 0) return -1;
    }
    PyDict_Clear(handles);
    return 0;
}

static PyObject *remove_hooks(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "remove_hooks(handles: dict, keys: dict, base: int)");
        return NULL;
    }
    long long base = PyLong_AsLongLong(args[2]);
    if (base == -1 && PyErr_Occurred()) return NULL;
    if (remove_all(args[0], args[1], base) < 0) return NULL;
    Py_RETURN_NONE;
}

/* ----- HookAdder ----------------------------------------------------------------------------- */
/* The owner of a capture's hooks: its death removes them (no weakref.finalize per trace).
 *
 * Not tracked by the collector, on purpose: the Python path needs a finalizer because the collector
 * clears the weakrefs in ``handles`` together with a dead trace's other garbage before finalizers run.
 * An untracked owner's reference keeps ``handles`` out of that garbage (the collector cannot account
 * for it), so its weakrefs are intact when the trace's cycle is cleared and this deallocator runs.  It
 * can close no cycle: nothing it holds leads back to it (the fallback must not hold the capture). */
typedef struct {
    PyObject_HEAD
    Sink *sink;
    PyObject *handles;      /* record index -> weakref to the hook dict holding its hook */
    PyObject *numbers;      /* record index -> sequence number of its backward node */
    PyObject *keys;         /* record index -> key, where a subclass's register_hook chose it */
    PyObject *plain;        /* the tensor type whose hooks are added here (torch.Tensor) */
    PyObject *ordered_dict; /* collections.OrderedDict, the hook dict Tensor.register_hook makes */
    PyObject *leaf_dict;    /* grads.py's LeafHooks, the one made for a leaf: leaf_dict(t) */
    PyObject *fallback;     /* the Python add_hook, for every other call */
    long long base;         /* a hook's key is base - index */
    vectorcallfunc vectorcall;
} HookAdder;

static PyObject *adder_vectorcall(HookAdder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *adder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *sink, *handles, *numbers, *keys, *plain, *ordered_dict, *leaf_dict, *fallback;
    long long base;
    static char *kwlist[] = {"sink", "handles", "numbers", "keys", "base", "plain", "ordered_dict", "leaf_dict",
                             "fallback", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!LOOOO:HookAdder", kwlist, &SinkType, &sink, &PyDict_Type,
                                     &handles, &PyDict_Type, &numbers, &PyDict_Type, &keys, &base, &plain,
                                     &ordered_dict, &leaf_dict, &fallback))
        return NULL;
    if (!PyDict_CheckExact(handles) || !PyDict_CheckExact(numbers) || !PyDict_CheckExact(keys)) {
        PyErr_SetString(PyExc_TypeError, "HookAdder: handles, numbers and keys must be dicts");
        return NULL;
    }
    HookAdder *self = (HookAdder *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    PyObject **slots[] = {(PyObject **)&self->sink, &self->handles, &self->numbers, &self->keys, &self->plain,
                          &self->ordered_dict, &self->leaf_dict, &self->fallback};
    PyObject *values[] = {sink, handles, numbers, keys, plain, ordered_dict, leaf_dict, fallback};
    for (size_t k = 0; k < sizeof(values) / sizeof(values[0]); k++) {
        Py_INCREF(values[k]);
        *slots[k] = values[k];
    }
    self->base = base;
    self->vectorcall = (vectorcallfunc)adder_vectorcall;
    return (PyObject *)self;
}

static void adder_dealloc(HookAdder *self) {
    /* May run while an exception propagates (the trace dropped by an unwinding frame): keep it. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    if (remove_all(self->handles, self->keys, self->base) < 0)
        PyErr_WriteUnraisable(NULL); /* (not self: reporting it would take a reference to a dying object) */
    PyErr_Restore(type, value, traceback);
    Py_DECREF(self->sink);
    Py_DECREF(self->handles);
    Py_DECREF(self->numbers);
    Py_DECREF(self->keys);
    Py_DECREF(self->plain);
    Py_DECREF(self->ordered_dict);
    Py_DECREF(self->leaf_dict);
    Py_DECREF(self->fallback);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Tensor.register_hook's own steps, without a RemovableHandle: the trace removes its hooks by key. */
static int add_plain_hook(HookAdder *self, PyObject *index, PyObject *t) {
    long long i = PyLong_AsLongLong(index);
    if (i == -1 && PyErr_Occurred()) return -1;
    int rc = -1;
    PyObject *hooks = NULL, *key = NULL, *hook = NULL, *ref = NULL, *number = NULL;
    PyObject *grad_fn = PyObject_GetAttr(t, str_grad_fn);
    if (grad_fn == NULL) return -1;
    hooks = PyObject_GetAttr(t, str_backward_hooks);
    if (hooks == NULL) goto done;
    if (hooks == Py_None || grad_fn != Py_None) { /* a dict on a node may be an older node's: see capture/grads.py */
        Py_SETREF(hooks, grad_fn != Py_None ? PyObject_CallNoArgs(self->ordered_dict)
                                            : PyObject_CallOneArg(self->leaf_dict, t));
        if (hooks == NULL || PyObject_SetAttr(t, str_backward_hooks, hooks) < 0) goto done;
        if (grad_fn != Py_None) {
            PyObject *r = PyObject_CallMethodOneArg(grad_fn, str_register_hook_dict, t);
            if (r == NULL) goto done;
            Py_DECREF(r);
        }
    }
    key = PyLong_FromLongLong(self->base - i);
    hook = make_hook(self->sink, index);
    if (key == NULL || hook == NULL || PyObject_SetItem(hooks, key, hook) < 0) goto done;
    ref = PyWeakref_NewRef(hooks, NULL);
    if (ref == NULL || PyDict_SetItem(self->handles, index, ref) < 0) goto done;
    if (grad_fn != Py_None) { /* the backward node's id, by which profilers name its work */
        number = PyObject_CallMethodNoArgs(grad_fn, str_sequence_nr);
        if (number == NULL || PyDict_SetItem(self->numbers, index, number) < 0) goto done;
    }
    rc = 0;
done:
    Py_DECREF(grad_fn);
    Py_XDECREF(hooks);
    Py_XDECREF(key);
    Py_XDECREF(hook);
    Py_XDECREF(ref);
    Py_XDECREF(number);
    return rc;
}

static PyObject *adder_vectorcall(HookAdder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || n < 2 || n > 4 || !PyLong_CheckExact(args[0]) || (PyObject *)Py_TYPE(args[1]) != self->plain)
        return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
    if (add_plain_hook(self, args[0], args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *adder_remove(HookAdder *self, PyObject *unused) {
    if (remove_all(self->handles, self->keys, self->base) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef adder_methods[] = {
    {"remove", (PyCFunction)adder_remove, METH_NOARGS, "Remove every hook added so far (also done on deletion)."},
    {NULL},
};

static PyTypeObject HookAdderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchlens_accel._grads.HookAdder",
    .tp_doc = "HookAdder(sink, handles, numbers, keys, base, plain, ordered_dict, leaf_dict, fallback): "
              "add_hook(index, t, func=None, module_call=-1); removes its hooks when deleted.",
    .tp_basicsize = sizeof(HookAdder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = adder_new,
    .tp_dealloc = (destructor)adder_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(HookAdder, vectorcall),
    .tp_methods = adder_methods,
};

static PyMethodDef grads_methods[] = {
    {"remove_hooks", (PyCFunction)(void (*)(void))remove_hooks, METH_FASTCALL,
     "remove_hooks(handles, keys, base): remove every hook named in handles (grads.py's _remove_all)."},
    {NULL},
};

static struct PyModuleDef grads_module = {
    PyModuleDef_HEAD_INIT, "_grads", "torchlens's gradient-capture hooks, compiled.", -1, grads_methods,
};

static int intern(PyObject **slot, const char *text) {
    *slot = PyUnicode_InternFromString(text);
    return *slot == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__grads(void) {
    if (intern(&str_requires_grad, "requires_grad") < 0 || intern(&str_detach, "detach") < 0 ||
        intern(&str_grad_fn, "grad_fn") < 0 || intern(&str_backward_hooks, "_backward_hooks") < 0 ||
        intern(&str_register_hook_dict, "_register_hook_dict") < 0 || intern(&str_sequence_nr, "_sequence_nr") < 0 ||
        intern(&str_release, "release") < 0)
        return NULL;
    if (PyType_Ready(&SinkType) < 0 || PyType_Ready(&HookType) < 0 || PyType_Ready(&HookAdderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&grads_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", TORCHLENS_ACCEL_ABI) < 0 ||
        PyModule_AddObjectRef(m, "Sink", (PyObject *)&SinkType) < 0 ||
        PyModule_AddObjectRef(m, "Hook", (PyObject *)&HookType) < 0 ||
        PyModule_AddObjectRef(m, "HookAdder", (PyObject *)&HookAdderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
