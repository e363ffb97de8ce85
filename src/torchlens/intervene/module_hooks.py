"""Module sites: a forward hook on each site module, run after the module's own hooks, replaces the
output of the calls the tracing thread makes.  A call made on another thread is neither recorded nor edited (capture
is thread-local); the runtime notes the module so that the trace can say so."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

import torch
import torch.compiler as _compiler
import torch.nn.modules.module as _module_globals

from ..errors import warn_user
from ..record.columns import MODULE_CALL_MODULE, MODULE_CALL_OUTPUTS
from ..capture.source import CALL_IMPL
from ..capture.state import StopForward
from ..capture.teardown import HookHandles
from ..tree import tensor_leaves

if TYPE_CHECKING:
    from .runtime import Interventions


class ModuleHooks(HookHandles):
    """Forward hooks on the module sites' modules, for the trace.  The edit hook is registered on each
    site module after the module's own hooks (torch runs them in registration order), and moved after any
    registered since as each call begins, so it sees what the module's hooks made and callers receive the
    edited value, as from a hook the user added last.  Torch runs a module's hooks inside the call
    ``ModuleCallTracker`` records, so the call is on ``state.module_stack`` in both; the call's outputs are
    recorded when it returns, after the edit hook replaced them (or by the edit hook itself when it stops the
    forward).  Only the site modules get hooks: every other module call runs as in a plain trace."""

    def __init__(self, runtime: Interventions, st, root):
        super().__init__()
        self.runtime, self.st, self.root = runtime, st, root

    def install(self) -> None:
        runtime, st, root, owner = self.runtime, self.st, self.root, threading.get_ident()
        counts: dict = {}
        open_calls: list = []  # (module, module call index, call number) of site modules now running
        edit_keys: dict = {}  # id(site module) -> the key of its edit hook in the module's _forward_hooks

        # Both step aside while Dynamo compiles a body of torch.cond (or while_loop, map, scan) calling a site
        # module: that call is inside one op, unseen, and Dynamo cannot trace the thread check.
        def pre_hook(module, args):
            if _compiler._is_compiling_flag or st.acting:  # an action's own call: none of the forward's
                return
            if threading.get_ident() != owner:  # not recorded, so not edited: said after the trace
                if not _a_site_of_its_own_trace(module):
                    runtime.called_elsewhere.add(id(module))
                return
            counts[id(module)] = number = counts.get(id(module), 0) + 1
            _run_last(module._forward_hooks, edit_keys[id(module)])
            # With the exception being handled where the call began (None, but for a model called
            # inside an except block): another one at its end is an exception raised in the call.
            open_calls.append((module, st.module_stack[-1], number, sys.exc_info()[1]))

        pre_hook.site_of_thread = owner  # read by the pre-hooks of other threads' traces of the same model

        def post_hook(module, args, output):
            if _compiler._is_compiling_flag or st.acting or threading.get_ident() != owner or not open_calls \
                    or open_calls[-1][0] is not module:
                return None
            _, module_call, number, handled = open_calls.pop()
            if output is None or sys.exc_info()[1] is not handled:
                # A module returning nothing, or torch running this always_call hook while unwinding from
                # an exception the forward or one of the module's hooks raised: the call produced no output
                # its caller receives, so there is nothing to edit and no stop_after site reached.
                return None
            with torch._C.DisableTorchFunction():
                new = runtime.at_module_output(st, module, module_call, number, output)
            stop = next((s for s in runtime.sites_of_call(module, number) if s.stop), None)
            if stop is not None:
                runtime.stopped_at = f"{stop.address}:{number}"
                # The call ends here, inside it: record what it returned, as its end would have (objects'
                # attributes included, as capture/modules.py's bound_output reads a result).
                returned = output if new is None else new
                st.module_calls[module_call][MODULE_CALL_OUTPUTS] = tuple(
                    st.bound_producer(t) for _, t in tensor_leaves(returned, attrs=True))
                run_always_called_hooks(st)
                raise StopForward
            return new

        for module in _site_modules(runtime.module_sites, root):
            # The count first, before the module's own pre-hooks, so it numbers every call the tracker
            # records; the edit last, after its own forward hooks (always_call: an exception pops the count).
            self.hook(module, pre_hook, pre=True, prepend=True)
            self.hook(module, post_hook, pre=False, always_call=True)
            edit_keys[id(module)] = self._handles[-1].id


def _a_site_of_its_own_trace(module) -> bool:
    """Whether the calling thread traces with a site at ``module`` (two threads tracing one model): that trace records
    and edits this call as its sites say, so it is none of another trace's to call unedited."""
    thread = threading.get_ident()
    return any(getattr(hook, "site_of_thread", None) == thread for hook in list(module._forward_pre_hooks.values()))


def _run_last(hooks: dict, key) -> None:
    """Move the hook at ``key`` after every other forward hook of its module: a hook the model registered since
    the trace began (transformers installs its hidden-state recorders during a model's first call) runs before the
    edit, as it would from the start of any later trace."""
    if key in hooks and next(reversed(hooks)) != key:
        hooks[key] = hooks.pop(key)


def _site_modules(module_sites, root) -> list:
    """Each module object named by a module site, once (an alias names the same object), the root aside:
    its output is the trace's output."""
    modules = {id(site.module): site.module for site in module_sites if site.module is not root}
    return list(modules.values())


def run_always_called_hooks(st) -> None:
    """Run the ``always_call=True`` forward hooks a stop is about to skip, as torch runs them for a module call an
    exception leaves: ``StopForward`` is a BaseException, which ``_call_impl`` lets through without them, so a
    forward pre-hook and its always-called forward hook would be left unpaired by every call the stop leaves open
    (torch's composable ``checkpoint`` would leave its saved-tensor hooks pushed, failing every later backward; a
    stack of one's own would keep its entries; FSDP2 registers its post-forward this way too).  Each open call's
    hooks run as torch's except block runs them, innermost call first, with the arguments its pre-hooks made and
    the result it had (None, for a call whose forward never returned), skipping those the call ran already; one
    that raises is silenced with a warning, as torch does.  They run after the stop, so their torch calls and module
    calls are no ops or calls of the trace."""
    left = [st.module_calls[k][MODULE_CALL_MODULE] for k in reversed(st.module_stack)]
    if isinstance(st.root, torch.nn.Module):
        left.append(st.root)
    frame, acting, st.acting = sys._getframe(1), st.acting, True
    try:
        with torch._C.DisableTorchFunction():
            while frame is not None and left:
                # Matched by identity, not in stack order: a class whose own _call_impl never runs torch's has no
                # such frame, and must not keep the calls around it from theirs.
                if frame.f_code is CALL_IMPL:
                    module = frame.f_locals.get("self")
                    k = next((k for k, m in enumerate(left) if m is module), -1)
                    if k >= 0:
                        _run_left_hooks(frame.f_locals)
                        del left[k]
                frame = frame.f_back
    finally:
        st.acting = acting


def _run_left_hooks(call: dict) -> None:
    """Torch's except block of ``_call_impl`` for the call whose locals are ``call``: a call that took the fast path
    (no hooks anywhere) has no ``called_always_called_hooks`` and nothing to run."""
    called = call.get("called_always_called_hooks")
    if called is None:
        return
    module, args, kwargs, result = call["self"], call["args"], call["kwargs"], call["result"]
    hooks = [(key, hook, False, "global module forward hook")
             for key, hook in _module_globals._global_forward_hooks.items()
             if key in _module_globals._global_forward_hooks_always_called]
    hooks += [(key, hook, key in module._forward_hooks_with_kwargs, "module forward hook")
              for key, hook in module._forward_hooks.items() if key in module._forward_hooks_always_called]
    for key, hook, with_kwargs, kind in hooks:
        if key in called:
            continue
        called.add(key)
        try:
            new = hook(module, args, kwargs, result) if with_kwargs else hook(module, args, result)
            result = result if new is None else new
        except Exception as exc:  # noqa: BLE001 - as torch: the stop goes on, the hook's failure is said
            warn_user(f"{kind} with ``always_call=True`` raised an exception that was silenced as the forward "
                      f"stopped at stop_after=: {exc}")
