"""The engine connectors' configuration checks (tutti._engine.parse_config and its field checks):
the extra-config JSON comes from the engine's command line, so every value it can hold is
refused with a ConfigError naming the field, never another exception."""

from __future__ import annotations

import json

import pytest

import tutti
from tutti._engine import (
    INT_FIELD_MAX,
    REQUESTS_MAX_LIMIT,
    TIMEOUT_MAX_S,
    ConfigError,
    Field,
    bounded_timeout,
    parse_config,
    positive,
    requests_in_range,
)


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


@pytest.mark.parametrize("given", ['{"slots_max": 18446744073709551616}', '{"slots_max": 100000000000000000000}'])
def test_an_integer_past_what_the_binding_takes_is_a_config_error_naming_the_field_and_bound(given):
    # Goal: tutti.Store.open takes create_bytes and slots_max as u64 (crates/python/src/store.rs),
    # and PyO3 raises a bare OverflowError past 2**64 - 1: every int field is bounded there, in
    # parse_config, and a value the binding takes still passes.
    fields = {"slots_max": Field(int, "slots", check=positive)}
    with pytest.raises(ConfigError, match=r"where: field 'slots_max' = \d+: must be at most 18446744073709551615 \(2\*\*64 - 1\)"):
        parse_config("where", json.loads(given), fields)
    assert parse_config("where", {"slots_max": INT_FIELD_MAX}, fields) == {"slots_max": 2**64 - 1}
    # Past the 4300 digits str() takes (a caller other than json.loads), the message still forms.
    with pytest.raises(ConfigError, match=r"where: field 'slots_max' = an integer of 20001 bits: must be at most"):
        parse_config("where", {"slots_max": 1 << 20000}, fields)
    # A field that takes an int or a bool (SGLang's interface_v1) is bounded too; a bool is not an int here.
    flag = {"flag": Field((int, bool), "1")}
    with pytest.raises(ConfigError, match=r"field 'flag' = \d+: must be at most"):
        parse_config("where", {"flag": 2**64}, flag)
    assert parse_config("where", {"flag": True}, flag) == {"flag": True}


def test_requests_max_is_bounded_as_the_binding_bounds_it():
    # Goal: tutti.Store.open/attach refuse requests_max past REQUESTS_MAX_LIMIT (65536): the
    # connectors' requests_max fields say so naming the field, and the limit itself passes.
    fields = {"requests_max": Field(int, "requests", check=requests_in_range)}
    assert parse_config("where", {"requests_max": REQUESTS_MAX_LIMIT}, fields) == {"requests_max": 65536}
    for value in (REQUESTS_MAX_LIMIT + 1, 2**64 - 1):
        with pytest.raises(ConfigError, match=r"where: field 'requests_max' = \d+: must be at most 65536"):
            parse_config("where", {"requests_max": value}, fields)
    with pytest.raises(ConfigError, match=r"field 'requests_max' = 0: must be positive"):
        parse_config("where", {"requests_max": 0}, fields)


def test_the_bounds_are_the_bindings():
    # Goal: INT_FIELD_MAX and REQUESTS_MAX_LIMIT are what tutti.Store.open takes (they restate
    # crates/python/src/store.rs): slots_max and create_bytes extract up to INT_FIELD_MAX, and
    # requests_max is refused past REQUESTS_MAX_LIMIT. queue_depth = 1 makes every call fail
    # at the queue options' check, after the arguments are taken and before anything opens.
    geometry = tutti.ModelGeometry(layers=1, kv_heads=1, head_dim=64, dtype_bytes=2, block_tokens=16)
    for name in ("slots_max", "create_bytes"):
        with pytest.raises(tutti.InvalidArgument, match="queue_depth = 1"):
            tutti.Store.open("emu:mem:1g", geometry, queue_depth=1, **{name: INT_FIELD_MAX})
        with pytest.raises(OverflowError):
            tutti.Store.open("emu:mem:1g", geometry, queue_depth=1, **{name: INT_FIELD_MAX + 1})
    with pytest.raises(tutti.InvalidArgument, match=rf"requests_max = {REQUESTS_MAX_LIMIT + 1} \(1..={REQUESTS_MAX_LIMIT}\)"):
        tutti.Store.open("emu:mem:1g", geometry, requests_max=REQUESTS_MAX_LIMIT + 1)
