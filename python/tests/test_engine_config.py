"""The engine connectors' configuration checks (tutti._engine.parse_config and its field checks):
the extra-config JSON comes from the engine's command line, so every value it can hold is
refused with a ConfigError naming the field, never another exception."""

from __future__ import annotations

import json

import pytest

from tutti._engine import TIMEOUT_MAX_S, ConfigError, Field, bounded_timeout, parse_config


def test_an_integer_too_large_for_a_float_field_is_a_config_error_naming_the_field():
    # Goal: json.loads takes integers of up to 4300 digits, and float() of one past ~1.8e308
    # raises OverflowError: the connector's caller must get a ConfigError naming the field.
    given = json.loads('{"timeout_s": 1' + "0" * 400 + "}")
    with pytest.raises(ConfigError, match=r"where: field 'timeout_s' = an integer of 1329 bits: too large"):
        parse_config("where", given, {"timeout_s": Field(float, "seconds", check=bounded_timeout)})
    # Past the 4300 digits str() takes (a caller other than json.loads), the message still forms.
    with pytest.raises(ConfigError, match=r"where: field 'timeout_s' = an integer of \d+ bits: too large"):
        parse_config("where", {"timeout_s": 1 << 20000}, {"timeout_s": Field(float, "seconds")})
    assert parse_config("where", {"timeout_s": 10**9}, {"timeout_s": Field(float, "seconds")}) == {"timeout_s": 1e9}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (float("inf"), r"must be at most 1e\+09 seconds \(and finite\)"),
        (TIMEOUT_MAX_S * 2, r"must be at most 1e\+09 seconds"),
        (float("nan"), r"must be positive"),
        (0, r"must be positive"),
        (-1.5, r"must be positive"),
    ],
)
def test_a_timeout_that_is_not_positive_and_bounded_is_refused_naming_the_field(value, problem):
    # Goal: the timeouts' check (shared by tutti.vllm and tutti.sglang) refuses what the binding
    # would refuse later (infinity, past TIMEOUT_MAX_S) or what means no wait at all.
    with pytest.raises(ConfigError, match=r"where: field 't' = .*: " + problem):
        parse_config("where", {"t": value}, {"t": Field(float, "seconds", check=bounded_timeout)})
    assert parse_config("where", {"t": TIMEOUT_MAX_S}, {"t": Field(float, "seconds", check=bounded_timeout)}) == {"t": TIMEOUT_MAX_S}
