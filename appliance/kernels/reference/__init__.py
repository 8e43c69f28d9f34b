"""Plain-torch reference kernels: the oracle for every other backend and the CPU path."""
from __future__ import annotations

from appliance.kernels.reference import activation, attention, linear, norm, rope, rope_store, sampling  # noqa: F401
