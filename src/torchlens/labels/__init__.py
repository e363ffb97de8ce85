"""Labeling: turning raw capture order into the ``{type}_{typeIdx}_{layerIdx}:{pass}`` grammar."""
