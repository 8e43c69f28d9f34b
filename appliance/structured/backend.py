"""The one place that imports xgrammar (a dependency of appliance; its absence is a clear 400, not a crash)."""
from __future__ import annotations

from types import ModuleType

from appliance.structured.errors import StructuredOutputUnavailable


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def require_xgrammar() -> ModuleType:
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputUnavailable() from None
    return xgrammar
