"""Capture: interposition (mode.py), module calls (modules.py), user source lines (source.py), the save
policy (saving.py), the fast-path shim (fastpath.py), and the driver (session.py)."""
