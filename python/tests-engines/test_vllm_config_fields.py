"""The vLLM connector's and tier's configuration tables (tutti.vllm's EXTRA_CONFIG_FIELDS and
TIER_CONFIG_FIELDS) as parse_config checks them: every integer field is bounded by what
tutti.Store takes, refused with a ConfigError naming the field, never an OverflowError from the
binding at attach or at the tier's construction."""

from __future__ import annotations

import pytest
from tutti._engine import INT_FIELD_MAX, REQUESTS_MAX_LIMIT, ConfigError, parse_config
from tutti.vllm.connector import EXTRA_CONFIG_FIELDS
from tutti.vllm.tier import TIER_CONFIG_FIELDS

CONNECTOR = {"socket": "/run/tutti/tuttid.sock"}
TIER = {"devices": "emu:/tmp/pool.img"}


@pytest.mark.parametrize(
    ("fields", "base", "name"),
    [
        (EXTRA_CONFIG_FIELDS, CONNECTOR, "requests_max"),
        (TIER_CONFIG_FIELDS, TIER, "create_bytes"),
        (TIER_CONFIG_FIELDS, TIER, "slots_max"),
        (TIER_CONFIG_FIELDS, TIER, "requests_max"),
        (TIER_CONFIG_FIELDS, TIER, "queue_max"),
    ],
)
def test_an_integer_past_what_the_binding_takes_names_the_field(fields, base, name):
    # Goal: {"slots_max": 2**64} (json.loads takes it) is a ConfigError naming slots_max, not
    # PyO3's "int too big to convert" from tutti.Store.open (u64) at the tier's construction.
    with pytest.raises(ConfigError, match=rf"where: field '{name}' = 18446744073709551616: must be at most"):
        parse_config("where", {**base, name: 2**64}, fields)


@pytest.mark.parametrize(("fields", "base"), [(EXTRA_CONFIG_FIELDS, CONNECTOR), (TIER_CONFIG_FIELDS, TIER)])
def test_requests_max_is_bounded_as_the_binding_bounds_it(fields, base):
    # Goal: tutti.Store refuses requests_max past REQUESTS_MAX_LIMIT: refused here naming the
    # field; the limit itself passes.
    with pytest.raises(ConfigError, match=r"field 'requests_max' = 65537: must be at most 65536"):
        parse_config("where", {**base, "requests_max": REQUESTS_MAX_LIMIT + 1}, fields)
    assert parse_config("where", {**base, "requests_max": REQUESTS_MAX_LIMIT}, fields)["requests_max"] == REQUESTS_MAX_LIMIT


def test_the_largest_u64_still_passes_for_create_bytes_and_slots_max():
    # Goal: a value tutti.Store.open takes is not refused by the bound.
    parsed = parse_config("where", {**TIER, "create_bytes": INT_FIELD_MAX, "slots_max": INT_FIELD_MAX}, TIER_CONFIG_FIELDS)
    assert (parsed["create_bytes"], parsed["slots_max"]) == (2**64 - 1, 2**64 - 1)
