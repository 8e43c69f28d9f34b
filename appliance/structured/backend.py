"""The one place that imports xgrammar (an optional dependency: appliance[xgrammar])."""
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
