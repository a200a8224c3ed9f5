"""Old import paths of moved modules: each stays importable for one release as a thin alias that re-exports the
module's names from its new home and emits a ``DeprecationWarning`` naming the new path."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["alias_module"]


def alias_module(old: str, new: str, namespace: dict[str, Any], *, removed_in: str = "0.2") -> None:
    """Fill ``namespace`` (the alias module's ``globals()``) with every name of module ``new`` (private ones too,
    so code that reached into the old module keeps working) and warn that ``old`` moved.

    The alias holds the same objects, not copies: patching an attribute of the old module does not reach the new
    one, so tests and tools should move to ``new``.
    """
    warnings.warn(
        f"{old} moved to {new}; the old path is an alias that will be removed in ppo-core {removed_in}",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    namespace.update({k: v for k, v in vars(module).items() if not (k.startswith("__") and k.endswith("__"))})
    if hasattr(module, "__all__"):
        namespace["__all__"] = list(module.__all__)
