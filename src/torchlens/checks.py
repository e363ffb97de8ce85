"""The one way a public function checks a number, a count or a flag it was given, before any forward runs.

Each check names the parameter, says what was wrong with the value, and ends with the caller's own advice on
what to give (``"give a number of bytes (2**30 for 1 GiB), or None for no limit"``), so every message reads
``who: name=value <what is wrong>; <advice>``; a call that needs gradients is refused inside inference mode.
A bool is never taken for a number (``True`` is an int to Python, but ``positions=True`` is a slip, not
dimension 1), and NaN never passes: every comparison with it is false, so a NaN budget or tolerance would
quietly mean "no limit" or "refuse everything".
"""

import inspect
import math
import numbers
import os
import types


def check_number(value, name: str, advice: str, *, who: str = "", at_least=None, finite: bool = False,
                 complex_ok: bool = False, at_most=None):
    """``value`` when it is a real number (or, with ``complex_ok``, a complex one; never a bool, never NaN),
    ``>= at_least`` and ``<= at_most`` when those are given, and not infinite when ``finite``; otherwise a
    TypeError or ValueError naming ``name`` and ending with ``advice``."""
    kind = numbers.Complex if complex_ok else numbers.Real  # a Decimal is neither: it mixes with no float
    if isinstance(value, bool) or not isinstance(value, kind):
        _refuse(TypeError, who, name, value, is_a(value), advice)
    if value != value:  # NaN, real or complex
        _refuse(ValueError, who, name, value, "is not a number (NaN)", advice)
    if finite and _is_infinite(value):
        _refuse(ValueError, who, name, value, "is infinite", advice)
    if at_least is not None:
        _check_at_least(value, name, advice, who, at_least)
    if at_most is not None and value > at_most:
        _refuse(ValueError, who, name, value, f"is above {at_most:g}", advice)
    return value


# The longest wait a timeout may ask for, in seconds (about 31 years): torch takes timeouts as a timedelta, which
# overflows past about 2.7 million years, and the process group's store in whole milliseconds.
LONGEST_WAIT_S = 1e9


def check_int(value, name: str, advice: str, *, who: str = "", at_least=None) -> int:
    """``value`` when it is an int (not a bool, not a float such as 2.0) and ``>= at_least`` when that is given;
    otherwise a TypeError or ValueError naming ``name`` and ending with ``advice``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _refuse(TypeError, who, name, value, f"{is_a(value)}, not an int", advice)
    if at_least is not None:
        _check_at_least(value, name, advice, who, at_least)
    return value


def as_position(key):
    """``key`` as an int when it is an integer other than a bool (a NumPy integer, from ``np.argsort`` or a
    DataFrame's index, is a position, as a list takes it); any other key unchanged, for its reader to judge."""
    if isinstance(key, numbers.Integral) and not isinstance(key, (bool, int)):
        return int(key)
    return key


def check_flag(value, name: str, advice: str = "give True or False", *, who: str = "") -> bool:
    """``value`` when it is True or False: a string such as ``"no"`` is true to Python, and would be read as
    the opposite of what it says."""
    if value is not True and value is not False:
        _refuse(TypeError, who, name, value, f"{is_a(value)}, not True or False", advice)
    return value


def asks_for_grads(grads) -> bool:
    """Whether ``grads=`` asks for gradients (``capture.grads.grad_capture`` makes none otherwise), without reading
    its truth: ``"none"`` is a true string asking for none, and a tensor has no truth to read."""
    return grads is not None and grads is not False and not (isinstance(grads, str) and grads == "none")


def check_path(value, name: str, advice: str, *, who: str = ""):
    """``value`` as a str path (``os.fspath``: a str, bytes or ``pathlib.Path``; bytes decoded as the file system
    names them, since the paths built from it join str names, which bytes cannot be joined with), a leading
    ``~`` expanded to the home folder as a shell would (else ``log.save("~/runs/a")`` made a folder named ``~``
    in the working folder); otherwise a TypeError naming ``name``, where Python's own ("expected str, bytes or
    os.PathLike object, not int") names no parameter."""
    try:
        return os.path.expanduser(os.fsdecode(os.fspath(value)))
    except TypeError:
        _refuse(TypeError, who, name, value, is_a(value), advice)


def check_file_to_write(value, name: str, advice: str, *, who: str = ""):
    """``value`` as a path (see ``check_path``) naming a file that can be written: not a folder, and either a
    file it may write or a new file in a folder that exists and is writable; otherwise a ValueError naming
    ``name``.  Called before the work whose result
    the file receives, so that a slip in the name is not found only after minutes of layout or profiling."""
    path = check_path(value, name, advice, who=who)
    problem = unwritable_file(path)
    if problem:
        _refuse(ValueError, who, name, value, problem, advice)
    return path


def folder_of(path: str) -> str:
    """The folder that ``path`` lies in, as the system will resolve it: ``sub/../run`` lies in ``sub/..``, which
    exists only once ``sub`` does (``os.path.abspath`` would say the current folder, which exists)."""
    trimmed = path.rstrip(os.sep + (os.altsep or "")) or path  # "run/" names run, not a file in it
    return os.path.dirname(trimmed) or os.curdir


def unwritable_file(path) -> str:
    """Why ``path`` cannot be written as a file (``"is a folder"``, ``"is in <folder>, which does not exist"``),
    or ``""`` when it can: the one check behind ``check_file_to_write`` and the command line's output flags.  An
    empty path names no file: opening it fails only once the work is done, and the command line took it for no file."""
    if not path:
        return "is empty"
    if os.path.isdir(path):
        return "is a folder"
    if os.path.isfile(path):  # written in place: the file's own permission decides, not its folder's
        return "" if os.access(path, os.W_OK) else "is a file that is not writable"
    folder = folder_of(path)
    # Named absolute, as given: normalizing "missing/.." would name the current folder, which exists.
    shown = os.path.join(os.getcwd(), folder) if os.pardir in folder.split(os.sep) else os.path.abspath(folder)
    if not os.path.isdir(folder):
        return f"is in {shown}, which {'is not a folder' if os.path.lexists(folder) else 'does not exist'}"
    if not os.access(folder, os.W_OK):
        return f"is in {shown}, which is not writable"
    return overlong_name(path)


def overlong_name(path) -> str:
    """Why a part of ``path`` not made yet cannot be made: a name longer than its file system allows, or ``""``.
    Asked before the work whose result the path receives: the system's "File name too long" comes only as the
    file or folder is made, after the layout, the profile or a whole trace was written beside it."""
    missing, head = [], os.path.abspath(path)
    while not os.path.lexists(head) and os.path.dirname(head) != head:
        missing.append(os.path.basename(head))
        head = os.path.dirname(head)
    try:
        limit = os.pathconf(head, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no such query here (Windows), or no answer for this folder
        return ""
    for name in missing:
        size = len(os.fsencode(name))
        if size > limit:
            return f"has a name of {size} bytes ({name[:24]}...), longer than the {limit} its file system allows"
    return ""


def check_grad_possible(who: str) -> None:
    """Refuse, before any run, a call that needs gradients made inside ``torch.inference_mode()``: no tensor can
    require grad there (``torch.no_grad()`` can be lifted for the runs; inference mode cannot)."""
    import torch

    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{who} needs gradients and was called inside torch.inference_mode(), where no tensor can "
                           "require grad; call it outside inference mode")


def check_takes(func, count: int, called_as: str, advice: str) -> None:
    """Refuse, before any run, a callable that cannot take the ``count`` positional arguments it will be called
    with (``lambda t: t * 0`` where ``f(tensor, op)`` is called): it would fail mid-run with Python's bare
    ``TypeError``, which names neither the option nor how it is called.  ``called_as`` says how it is called
    (``"an intervention action is called as action(tensor, op)"``).  A callable without a signature (a builtin
    or C callable) passes: its call answers."""
    if _plainly_takes(func, count):
        return
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*[None] * count)
    except TypeError as exc:
        name = getattr(func, "__qualname__", None) or type(func).__name__
        what = "that argument" if count == 1 else f"those {_COUNTS.get(count, count)} arguments"
        raise TypeError(f"{called_as}, but {name}{signature} cannot take {what} ({exc}); {advice}") from None


_COUNTS = {2: "two", 3: "three"}
_VARARGS = inspect.CO_VARARGS


def _plainly_takes(func, count: int) -> bool:
    """Whether a plain Python function (a lambda, a ``def``) takes ``count`` positional arguments, read from its
    code object and defaults: building its ``inspect.signature`` costs each intervened trace tens of us per
    callable.  False when it does not, or when the signature says more than the code (attributes such as
    ``__wrapped__`` or ``__signature__``, which ``check_takes`` then reads)."""
    if type(func) is not types.FunctionType or vars(func):
        return False
    code = func.__code__
    required = code.co_argcount - len(func.__defaults__ or ())
    if count < required or (count > code.co_argcount and not code.co_flags & _VARARGS):
        return False
    keyword_only = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    defaults = func.__kwdefaults__ or {}
    return all(name in defaults for name in keyword_only)


def _check_at_least(value, name, advice, who, at_least) -> None:
    if not isinstance(value, numbers.Real):  # complex: no order
        _refuse(TypeError, who, name, value, f"{is_a(value)}, not a real number", advice)
    if value < at_least:
        _refuse(ValueError, who, name, value, "is negative" if at_least == 0 else f"is below {at_least}", advice)


def _is_infinite(value) -> bool:
    try:
        return math.isinf(abs(value))
    except OverflowError:  # an int too large for a float is finite
        return False


def check_model(model, who: str) -> None:
    """Refuse, in ``who``'s words and before any work, a model that cannot be run: a module class rather than an
    instance, or a value that is not callable (otherwise the refusal came from tl.trace, which was not called)."""
    if isinstance(model, type):
        raise TypeError(f"{who} needs the model to run (a module instance or a callable), got the class "
                        f"{model.__name__}, which is not an instance: pass a module instance, e.g. "
                        f"{who}({model.__name__}(...), ...)")
    if not callable(model):
        raise TypeError(f"{who} needs the model to run (a module instance or a callable), got {is_a(model)[3:]}, "
                        "which is not callable")


def is_a(value) -> str:
    """``"is a float"``, ``"is an int"``: what ``value`` is, for a message."""
    kind = type(value).__name__
    return f"is {'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def _refuse(error, who: str, name: str, value, problem: str, advice: str):
    shown = repr(value)
    if len(shown) > 60:  # a tensor given by mistake would print every value
        shown = shown[:57] + "..."
    raise error(f"{who + ': ' if who else ''}{name}={shown} {problem}; {advice}")
