"""The reference library's spelling of its commonest entry point, mapped onto ``tl.trace``.

``log_forward_pass(model, x, layers_to_save=...)`` is what many users of the reference library type
first.  Only arguments with an exact torchlens meaning are accepted; any other reference option is
refused with the torchlens way to get it, never silently dropped.
"""

from __future__ import annotations

import inspect

from .capture.session import trace
from .checks import check_flag, check_model
from .errors import REFERENCE_OPTIONS


def log_forward_pass(model, input_args, input_kwargs=None, layers_to_save="all", save_gradients=False,
                     **reference_options):
    """``tl.trace(model, input_args, input_kwargs, save=layers_to_save)`` under the reference's names;
    ``save_gradients=True`` also keeps, from a later backward, the gradients of the layers saved
    (``grads=`` with the same selection)."""
    for option, value in reference_options.items():
        if option == "vis_opt" and value == "none":
            continue  # the reference's default: no picture
        instead = REFERENCE_OPTIONS.get(option, "see tl.trace's arguments")
        raise TypeError(f"log_forward_pass: {option}= is a reference-library option torchlens does not take; "
                        f"{instead}")
    check_model(model, "log_forward_pass")
    # save_gradients="no" is true to Python: it would keep gradients.
    check_flag(save_gradients, "save_gradients", "give True to keep the saved layers' gradients, False not to",
               who="log_forward_pass")
    save = "none" if layers_to_save is None else layers_to_save
    grads = False
    if save_gradients and save != "none":
        grads = True if save == "all" else save
    return trace(model, _positional_arguments(model, input_args), input_kwargs, save=save, grads=grads)


def _positional_arguments(model, input_args) -> tuple:
    """The reference's reading of ``input_args``: a list or tuple holds the positional arguments
    (``log_forward_pass(model, [x, y])`` calls ``model(x, y)``), unless forward takes exactly one positional
    parameter and several items were given, which are then that one argument; any other value is the one
    argument."""
    if not isinstance(input_args, (list, tuple)):
        return (input_args,)
    if len(input_args) > 1 and _number_of_positional_parameters(model) == 1:
        return (input_args,)
    return tuple(input_args)


def _number_of_positional_parameters(model):
    """How many positional parameters the model's forward (or the callable) takes; None for ``*args`` or an
    unreadable signature."""
    forward = getattr(model, "forward", model)
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)
