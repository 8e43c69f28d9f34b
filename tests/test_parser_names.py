"""config/parser_names.py names exactly the parsers server/parsers implements, and config refuses the rest."""
from __future__ import annotations

from appliance.config import build_config, check_supported
from appliance.config.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS
from appliance.server.parsers import reasoning_parser_names, tool_parser_names


def test_the_config_names_are_the_server_registries() -> None:
    assert set(reasoning_parser_names()) == REASONING_PARSERS
    assert set(tool_parser_names()) == TOOL_CALL_PARSERS


def test_a_parser_the_build_lacks_is_refused_and_one_it_has_is_not() -> None:
    lacking = check_supported(build_config(dotlist=["api.tool_call_parser=seed_oss", "api.reasoning_parser=seed_oss"]))
    assert any(m.startswith("api.tool_call_parser:") for m in lacking)
    assert any(m.startswith("api.reasoning_parser:") for m in lacking)
    having = check_supported(build_config(dotlist=["api.tool_call_parser=glm47", "api.reasoning_parser=gpt_oss"]))
    assert not any(m.startswith("api.") for m in having)
