"""The environment contract (remote_dspark.config, config.env): one case per variable and rule.

Every test passes its own environ dict; the process environment is never read.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from remote_dspark.config import env as config_env
from remote_dspark.config.api import CAP_MASKING_DEPTH_MODES, RemoteConfig, apply_cost_overrides, describe, n_out_table
from remote_dspark.config.env import ENV_ENDPOINT, POLICIES, markov_identity_from_env, remote_requested

P = "VLLM_DSPARK_REMOTE_"
IDENT = "ab" * 32
BASE = {ENV_ENDPOINT: "tcp://127.0.0.1:18620", P + "IDENTITY": IDENT}


def cfg_of(**overrides: str) -> RemoteConfig:
    """from_env over BASE plus ``NAME=value`` overrides (NAME without the REMOTE_ prefix)."""
    return RemoteConfig.from_env(env_of(**overrides))


def env_of(**overrides: str) -> dict[str, str]:
    env = dict(BASE)
    env.update({P + k: v for k, v in overrides.items()})
    return env


# --- the dataclass keeps the reference's shape --------------------------------------------

REFERENCE_FIELDS = [
    ("endpoint", dataclasses.MISSING),
    ("policy", dataclasses.MISSING),
    ("drafter_identity", dataclasses.MISSING),
    ("markov_identity", dataclasses.MISSING),
    ("timeout_ms", dataclasses.MISSING),
    ("connect_timeout_ms", dataclasses.MISSING),
    ("backoff_ms", dataclasses.MISSING),
    ("backoff_max_ms", dataclasses.MISSING),
    ("on_fail", dataclasses.MISSING),
    ("strict_start", dataclasses.MISSING),
    ("shadow_use", dataclasses.MISSING),
    ("want_margin", dataclasses.MISSING),
    ("remote_draft_ms", dataclasses.MISSING),
    ("remote_round_ms", dataclasses.MISSING),
    ("log_every", dataclasses.MISSING),
    ("stats_file", dataclasses.MISSING),
    ("async_mode", False),
    ("switch_interval_us", 500),
    ("hostflag_lib", ""),
    ("async_nap_us", 0),
    ("async_spin_us", 1000),
    ("async_watchdog_ms", 0),
    ("async_proxy", "thread"),
    ("async_respawns", 3),
    ("async_respawn_reset_s", 3600),
    ("fused_gather", None),
    ("n_out", "auto"),
    ("trip", 3),
    ("cooldown", 256),
    ("sampled_top32", False),
]
# This project's additions, after the reference's fields and with defaults, so code
# written against the reference keeps working.
ADDED_FIELDS = [
    ("metrics_port", 0),
    ("metrics_addr", "127.0.0.1"),
    ("async_standby", True),
    ("key", None),
    ("sampled_redraw", False),
]


def test_dataclass_fields_and_defaults_match_reference():
    got = [(f.name, f.default) for f in dataclasses.fields(RemoteConfig)]
    assert got == REFERENCE_FIELDS + ADDED_FIELDS


@pytest.mark.parametrize(
    "var,raw,why",
    [
        ("METRICS_PORT", "70000", "0..65535"),
        ("METRICS_PORT", "-1", "must be >= 0"),
        ("METRICS_PORT", "http", "not an integer"),
        ("METRICS_ADDR", "localhost", "not an IP address"),
    ],
)
def test_metrics_exporter_variables(var, raw, why):
    with pytest.raises(ValueError) as e:
        cfg_of(**{var: raw})
    assert P + var in str(e.value) and repr(raw) in str(e.value) and why in str(e.value)


def test_metrics_exporter_defaults_off_and_loopback():
    cfg = cfg_of()
    assert (cfg.metrics_port, cfg.metrics_addr) == (0, "127.0.0.1")
    assert cfg_of(METRICS_PORT="9464", METRICS_ADDR="::1").metrics_addr == "::1"


def test_public_constants():
    assert POLICIES == ("shadow", "resilience", "capacity")
    assert ENV_ENDPOINT == "VLLM_DSPARK_REMOTE"
    assert CAP_MASKING_DEPTH_MODES == ("conf", "confb", "confr")


def test_docstring_table_names_every_variable():
    for name in config_env.VARIABLES:
        short = name.replace(P, "REMOTE_", 1) if name.startswith(P) else name
        assert f"\n{short} " in config_env.__doc__, name


# --- defaults ----------------------------------------------------------------------------

DEFAULTS = {
    "policy": "shadow",
    "markov_identity": bytes(32),
    "timeout_ms": 50,
    "connect_timeout_ms": 1000,
    "backoff_ms": 1000,
    "backoff_max_ms": 30000,
    "on_fail": "target_only",
    "strict_start": False,
    "shadow_use": "local",
    "want_margin": True,
    "remote_draft_ms": None,
    "remote_round_ms": None,
    "log_every": 1024,
    "stats_file": "/tmp/dsv41-remote-dspark.json",
    "async_mode": False,
    "switch_interval_us": 500,
    "hostflag_lib": "",
    "async_nap_us": 0,
    "async_spin_us": 1000,
    "async_watchdog_ms": 0,
    "async_proxy": "thread",
    "async_respawns": 3,
    "async_respawn_reset_s": 3600,
    "fused_gather": None,
    "n_out": "auto",
    "trip": 3,
    "cooldown": 256,
    "sampled_top32": False,
}


@pytest.mark.parametrize("field,expected", DEFAULTS.items(), ids=list(DEFAULTS))
def test_default(field, expected):
    assert getattr(cfg_of(), field) == expected


def test_default_endpoint_has_no_bind():
    cfg = cfg_of()
    assert (cfg.endpoint.scheme, cfg.endpoint.host, cfg.endpoint.port) == ("tcp", "127.0.0.1", 18620)
    assert cfg.endpoint.bind is None


@pytest.mark.parametrize(
    "name,default",
    [("TIMEOUT_MS", 50), ("ASYNC", False), ("STATS_FILE", "/tmp/dsv41-remote-dspark.json")],
    ids=["int", "flag", "text"],
)
def test_blank_value_counts_as_unset(name, default):
    field = {"TIMEOUT_MS": "timeout_ms", "ASYNC": "async_mode", "STATS_FILE": "stats_file"}[name]
    assert getattr(cfg_of(**{name: "  "}), field) == default


@pytest.mark.parametrize("name", ["POLICY", "ON_FAIL", "SHADOW_USE", "ASYNC_PROXY", "FUSED_GATHER", "N_OUT"])
def test_a_blank_choice_raises_as_in_the_reference(name):
    """The reference takes a choice's default only when it is unset or empty; blanks are
    a value, and none of the choices."""
    with pytest.raises(ValueError, match=rf"{P}{name}='  ': expected one of"):
        cfg_of(**{name: "  "})
    assert cfg_of(**{name: ""}) == cfg_of()  # empty: the default


@pytest.mark.parametrize("policy,expected", [("shadow", True), ("resilience", False), ("capacity", False)])
def test_want_margin_default_follows_policy(policy, expected):
    assert cfg_of(POLICY=policy).want_margin is expected


# --- good values -------------------------------------------------------------------------

GOOD = [
    ("POLICY", "Capacity", "policy", "capacity"),
    ("ON_FAIL", "RAISE", "on_fail", "raise"),
    ("SHADOW_USE", "remote", "shadow_use", "remote"),
    ("ASYNC_PROXY", "process", "async_proxy", "process"),
    ("N_OUT", "0", "n_out", "0"),
    ("FUSED_GATHER", "1", "fused_gather", True),
    ("FUSED_GATHER", "0", "fused_gather", False),
    ("FUSED_GATHER", "AUTO", "fused_gather", None),
    ("STRICT_START", "yes", "strict_start", True),
    ("WANT_MARGIN", "off", "want_margin", False),
    ("TRIP", "0", "trip", 0),
    ("TIMEOUT_MS", " 75 ", "timeout_ms", 75),
    ("DRAFT_MS", "2.5", "remote_draft_ms", 2.5),
    ("DRAFT_MS", "0", "remote_draft_ms", 0.0),
    ("ROUND_MS", "1, 2,3,", "remote_round_ms", [1.0, 2.0, 3.0]),
    ("HOSTFLAG_LIB", " /opt/libdsv41_hostflag.so ", "hostflag_lib", "/opt/libdsv41_hostflag.so"),
    ("STATS_FILE", "/tmp/s.json", "stats_file", "/tmp/s.json"),
    ("IDENTITY", "0x" + "CD" * 32, "drafter_identity", bytes([0xCD]) * 32),
]


@pytest.mark.parametrize("name,raw,field,expected", GOOD, ids=[f"{n}={r.strip()}" for n, r, _, _ in GOOD])
def test_good_value(name, raw, field, expected):
    assert getattr(cfg_of(**{name: raw}), field) == expected


def test_sampled_top32_read_from_its_own_variable():
    env = dict(BASE, VLLM_DSPARK_SAMPLED_TOP32="1")
    assert RemoteConfig.from_env(env).sampled_top32 is True


# --- bad values: every one names the variable and the value ------------------------------

INT_VARS = [
    ("TIMEOUT_MS", 1),
    ("CONNECT_TIMEOUT_MS", 1),
    ("BACKOFF_MS", 1),
    ("BACKOFF_MAX_MS", 1),
    ("TRIP", 0),
    ("COOLDOWN", 1),
    ("ASYNC_NAP_US", 0),
    ("ASYNC_SPIN_US", 0),
    ("ASYNC_WATCHDOG_MS", 0),
    ("ASYNC_RESPAWNS", 0),
    ("ASYNC_RESPAWN_RESET_S", 0),
    ("SWITCH_INTERVAL_US", 0),
    ("LOG_EVERY", 0),
]

BAD = (
    [(P + n, "1.5") for n, _ in INT_VARS]  # not an integer
    + [(P + n, str(lo - 1)) for n, lo in INT_VARS]  # below the bound
    + [
        (ENV_ENDPOINT, "127.0.0.1:18620"),
        (ENV_ENDPOINT, "udp://h:1"),
        (ENV_ENDPOINT, "tcp://h:0"),
        (ENV_ENDPOINT, "tcp://h:port"),
        (ENV_ENDPOINT, "tcp://h:1?bind=eth0", "?bind='eth0'"),
        (ENV_ENDPOINT, "tcp://h:1?mtu=9000"),
        (P + "BIND", "10.0.0"),
        (P + "BIND", "fe80::1"),
        (P + "POLICY", "Fast"),
        (P + "IDENTITY", "abc"),
        (P + "IDENTITY", "zz" * 32),
        (P + "MARKOV_IDENTITY", "12"),
        (P + "MARKOV_IDENTITY", "g" * 64),
        (P + "ON_FAIL", "Retry"),
        (P + "STRICT_START", "maybe"),
        (P + "SHADOW_USE", "Both"),
        (P + "WANT_MARGIN", "2"),
        (P + "DRAFT_MS", "1,2"),
        (P + "DRAFT_MS", "-1"),
        (P + "DRAFT_MS", "nan"),
        (P + "DRAFT_MS", "fast"),
        (P + "DRAFT_MS", ","),
        (P + "ROUND_MS", "1,x"),
        (P + "ROUND_MS", "1,-2"),
        (P + "ROUND_MS", "1,inf"),
        (P + "ROUND_MS", " , "),
        (P + "ASYNC", "sure"),
        (P + "ASYNC_PROXY", "Fork"),
        (P + "FUSED_GATHER", "Maybe"),
        (P + "FUSED_GATHER", "2"),
        (P + "N_OUT", "5"),
        ("VLLM_DSPARK_SAMPLED_TOP32", "top"),
    ]
)


@pytest.mark.parametrize("case", BAD, ids=[f"{c[0].replace(P, '')}={c[1]}" for c in BAD])
def test_bad_value_names_variable_and_value(case):
    name, raw = case[:2]
    shown = case[2] if len(case) > 2 else f"={raw.strip()!r}"  # the offending part
    with pytest.raises(ValueError) as e:
        RemoteConfig.from_env(dict(BASE, **{name: raw}))
    assert str(e.value).startswith(name)
    assert shown in str(e.value)


@pytest.mark.parametrize("name", [P + "POLICY", P + "ON_FAIL", P + "FUSED_GATHER"])
def test_choice_error_keeps_raw_case(name):
    with pytest.raises(ValueError, match="'MiXeD'"):
        RemoteConfig.from_env(dict(BASE, **{name: "MiXeD"}))


# --- required variables ------------------------------------------------------------------


@pytest.mark.parametrize("raw", [None, "", "   "], ids=["unset", "empty", "blank"])
def test_endpoint_required(raw):
    env = {P + "IDENTITY": IDENT}
    if raw is not None:
        env[ENV_ENDPOINT] = raw
    assert not remote_requested(env)
    with pytest.raises(ValueError, match=f"^{ENV_ENDPOINT} is required"):
        RemoteConfig.from_env(env)


def test_remote_requested():
    assert remote_requested(BASE)


@pytest.mark.parametrize("raw", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_identity_required(raw):
    env = {ENV_ENDPOINT: BASE[ENV_ENDPOINT]}
    if raw is not None:
        env[P + "IDENTITY"] = raw
    with pytest.raises(ValueError, match=f"{P}IDENTITY is required"):
        RemoteConfig.from_env(env)


def test_identity_parsed():
    assert cfg_of().drafter_identity == bytes.fromhex(IDENT)


# --- bind --------------------------------------------------------------------------------


def test_bind_variable_sets_endpoint_bind():
    assert cfg_of(BIND="10.202.28.2").endpoint.bind == "10.202.28.2"


def test_bind_in_endpoint_query():
    env = dict(BASE, **{ENV_ENDPOINT: "o1rdma://10.202.28.1:18620?bind=10.202.28.2"})
    assert RemoteConfig.from_env(env).endpoint.bind == "10.202.28.2"


def test_bind_variable_agreeing_with_query():
    env = dict(BASE, **{ENV_ENDPOINT: "tcp://10.202.28.1:18620?bind=10.202.28.2", P + "BIND": "10.202.28.2"})
    assert RemoteConfig.from_env(env).endpoint.bind == "10.202.28.2"


def test_bind_conflict_names_both_values():
    env = dict(BASE, **{ENV_ENDPOINT: "tcp://10.202.28.1:18620?bind=10.202.28.2", P + "BIND": "10.202.28.3"})
    with pytest.raises(ValueError) as e:
        RemoteConfig.from_env(env)
    msg = str(e.value)
    assert f"{P}BIND='10.202.28.3'" in msg and "10.202.28.2" in msg


# --- cross-field rules -------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["shadow", "resilience"])
def test_async_needs_capacity(policy):
    with pytest.raises(ValueError) as e:
        cfg_of(ASYNC="1", POLICY=policy)
    assert f"{P}ASYNC=1" in str(e.value) and f"{P}POLICY" in str(e.value) and policy in str(e.value)


def test_async_with_capacity_accepted():
    assert cfg_of(ASYNC="1", POLICY="capacity").async_mode is True


def test_async_refuses_on_fail_raise():
    with pytest.raises(ValueError) as e:
        cfg_of(ASYNC="1", POLICY="capacity", ON_FAIL="raise")
    assert f"{P}ASYNC=1" in str(e.value) and f"{P}ON_FAIL='raise'" in str(e.value)


def test_backoff_max_below_backoff_prints_both_values():
    with pytest.raises(ValueError) as e:
        cfg_of(BACKOFF_MS="2000", BACKOFF_MAX_MS="500")
    assert f"{P}BACKOFF_MAX_MS=500" in str(e.value) and f"{P}BACKOFF_MS=2000" in str(e.value)


def test_sampled_redraw_needs_sampled_drafts():
    with pytest.raises(ValueError) as e:
        cfg_of(SAMPLED_REDRAW="1")
    assert f"{P}SAMPLED_REDRAW=1" in str(e.value) and "VLLM_DSPARK_SAMPLED_TOP32=1" in str(e.value)
    env = dict(BASE, VLLM_DSPARK_SAMPLED_TOP32="1", **{P + "SAMPLED_REDRAW": "1"})
    cfg = RemoteConfig.from_env(env)
    assert cfg.sampled_redraw is True and RemoteConfig.from_json(cfg.to_json()).sampled_redraw is True
    assert (P + "SAMPLED_REDRAW", "1", "env") in describe(cfg, env)  # check-config shows it
    assert cfg_of().sampled_redraw is False and (P + "SAMPLED_REDRAW", "0", "default") in describe(cfg_of(), BASE)
    with pytest.raises(ValueError, match=f"{P}SAMPLED_REDRAW='2'"):
        RemoteConfig.from_env(dict(env, **{P + "SAMPLED_REDRAW": "2"}))


def test_backoff_max_equal_to_backoff_accepted():
    assert cfg_of(BACKOFF_MS="700", BACKOFF_MAX_MS="700").backoff_max_ms == 700


# --- Markov identity ---------------------------------------------------------------------


def test_markov_identity_unset_is_zeros():
    assert markov_identity_from_env({}) == bytes(32)


def test_markov_identity_is_sha256_of_cache_file(tmp_path):
    cache = tmp_path / "markov.bin"
    cache.write_bytes(b"markov table")
    env = dict(BASE, VLLM_DSPARK_MARKOV_CACHE=str(cache))
    digest = hashlib.sha256(b"markov table").digest()
    assert markov_identity_from_env(env) == digest
    assert RemoteConfig.from_env(env).markov_identity == digest


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_markov_cache_unreadable_names_variable_and_path(tmp_path, kind):
    path = tmp_path / "nope" if kind == "missing" else tmp_path
    env = dict(BASE, VLLM_DSPARK_MARKOV_CACHE=str(path))
    with pytest.raises(ValueError) as e:
        RemoteConfig.from_env(env)
    assert f"VLLM_DSPARK_MARKOV_CACHE={str(path)!r}" in str(e.value)
    assert f"{P}MARKOV_IDENTITY" in str(e.value)


def test_markov_identity_override_wins_over_cache(tmp_path):
    env = dict(BASE, VLLM_DSPARK_MARKOV_CACHE=str(tmp_path / "unreadable"), **{P + "MARKOV_IDENTITY": "12" * 32})
    assert RemoteConfig.from_env(env).markov_identity == bytes([0x12]) * 32


# --- properties --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timeout,watchdog,expected",
    [("50", "0", 200), ("20", "0", 200), ("100", "0", 400), ("100", "75", 75)],
    ids=["auto-floor", "auto-floor-small", "auto-4x", "explicit"],
)
def test_watchdog_ms(timeout, watchdog, expected):
    assert cfg_of(TIMEOUT_MS=timeout, ASYNC_WATCHDOG_MS=watchdog).watchdog_ms == expected


@pytest.mark.parametrize("policy,expected", [("shadow", True), ("resilience", True), ("capacity", False)])
def test_keeps_local_drafter(policy, expected):
    assert cfg_of(POLICY=policy).keeps_local_drafter is expected


# --- describe ----------------------------------------------------------------------------


def test_describe_rows_cover_the_contract_in_order():
    env = env_of(TIMEOUT_MS="80", FUSED_GATHER="0", ROUND_MS="1,2")
    rows = describe(RemoteConfig.from_env(env), env)
    names = [r[0] for r in rows]
    assert names[: len(config_env.VARIABLES)] == list(config_env.VARIABLES)
    assert names[len(config_env.VARIABLES) :] == ["watchdog_ms", "keeps_local_drafter", "bind"]
    by = {r[0]: r[1:] for r in rows}
    assert by[ENV_ENDPOINT] == ("tcp://127.0.0.1:18620", "env")
    assert by[P + "IDENTITY"] == (IDENT, "env")
    assert by[P + "MARKOV_IDENTITY"] == ("00" * 32, "default")
    assert by[P + "TIMEOUT_MS"] == ("80", "env")
    assert by[P + "CONNECT_TIMEOUT_MS"] == ("1000", "default")
    assert by[P + "FUSED_GATHER"] == ("0", "env")
    assert by[P + "ROUND_MS"] == ("1,2", "env")
    assert by[P + "DRAFT_MS"] == ("", "default")
    assert by[P + "WANT_MARGIN"] == ("1", "default")
    assert by["watchdog_ms"] == ("320", "derived")
    assert by["keeps_local_drafter"] == ("1", "derived")


# --- apply_cost_overrides ----------------------------------------------------------------

ROUND6 = "1,2,3,4,5,6"


def costs(policy="capacity", draft=None, round_ms=None):
    over = {"POLICY": policy}
    if draft is not None:
        over["DRAFT_MS"] = draft
    if round_ms is not None:
        over["ROUND_MS"] = round_ms
    return cfg_of(**over)


def test_costs_shadow_returns_empty_and_writes_nothing():
    env = {"KEEP": "1"}
    cfg = costs("shadow", draft="2", round_ms=ROUND6)
    assert apply_cost_overrides(cfg, env, depth_policy_on=True, depth_mode="conf") == {}
    assert env == {"KEEP": "1"}


def test_costs_depth_policy_off_needs_none():
    env: dict[str, str] = {}
    assert apply_cost_overrides(costs(), env, depth_policy_on=False) == {}
    assert env == {}


@pytest.mark.parametrize(
    "draft,round_ms,missing",
    [
        (None, None, [P + "DRAFT_MS", P + "ROUND_MS"]),
        ("2", None, [P + "ROUND_MS"]),
        (None, ROUND6, [P + "DRAFT_MS"]),
    ],
    ids=["both", "round", "draft"],
)
@pytest.mark.parametrize("policy", ["capacity", "resilience"])
def test_costs_depth_policy_needs_both(policy, draft, round_ms, missing):
    env = {"KEEP": "1"}
    with pytest.raises(ValueError) as e:
        apply_cost_overrides(costs(policy, draft, round_ms), env, depth_policy_on=True, depth_mode="conf")
    assert "missing " + " and ".join(missing) in str(e.value)
    assert env == {"KEEP": "1"}


def test_costs_fixed_without_depth_file_needs_none():
    env: dict[str, str] = {}
    assert apply_cost_overrides(costs(), env, depth_policy_on=True, depth_mode="fixed") == {}
    assert env == {}


def test_costs_fixed_with_depth_file_needs_both():
    with pytest.raises(ValueError, match="missing"):
        apply_cost_overrides(costs(draft="2"), {}, depth_policy_on=True, depth_mode="fixed", depth_file="/tmp/depth")


def test_costs_confr_refused():
    env: dict[str, str] = {}
    with pytest.raises(ValueError, match="confr"):
        apply_cost_overrides(costs(draft="2", round_ms=ROUND6), env, depth_policy_on=True, depth_mode="confr")
    assert env == {}


@pytest.mark.parametrize(
    "round_ms,why",
    [("1,2,3", "3 values, expected 6"), ("0,1,2,3,4,5", "> 0 ms"), ("1,2,3,2,4,5", "non-decreasing")],
    ids=["wrong-length", "non-positive", "decreasing"],
)
def test_costs_round_table_rules(round_ms, why):
    env = {"KEEP": "1"}
    with pytest.raises(ValueError) as e:
        apply_cost_overrides(
            costs(draft="2", round_ms=round_ms), env, depth_policy_on=True, depth_mode="conf", num_spec=5
        )
    assert f"{P}ROUND_MS={round_ms!r}" in str(e.value) and why in str(e.value)
    assert env == {"KEEP": "1"}  # DRAFT_MS was valid and is still not written


def test_costs_written_into_given_environ():
    env = {"KEEP": "1", "VLLM_DSPARK_ROUND_MS": "9,9,9,9,9,9"}
    changed = apply_cost_overrides(
        costs("resilience", draft="2.5", round_ms="1,1.5,2,2,3,4"), env, depth_policy_on=True, depth_mode="confb"
    )
    assert changed == {"VLLM_DSPARK_ROUND_MS": "1,1.5,2,2,3,4", "VLLM_DSPARK_DRAFT_MS": "2.5"}
    assert env == dict(changed, KEEP="1")


def test_costs_partial_written_when_depth_policy_off():
    env: dict[str, str] = {}
    assert apply_cost_overrides(costs(draft="3"), env) == {"VLLM_DSPARK_DRAFT_MS": "3"}
    assert env == {"VLLM_DSPARK_DRAFT_MS": "3"}


def test_costs_num_spec_sets_expected_length():
    env: dict[str, str] = {}
    apply_cost_overrides(costs(round_ms="1,2,3"), env, num_spec=2)
    assert env == {"VLLM_DSPARK_ROUND_MS": "1,2,3"}


# --- n_out_table -------------------------------------------------------------------------

CAP = [0, 5, 4, 2, 1]


@pytest.mark.parametrize(
    "policy,n_out,mode,depth_file,cap,reason",
    [
        ("shadow", "auto", "conf", None, CAP, "shadow compares every position"),
        ("capacity", "0", "conf", None, CAP, f"{P}N_OUT=0"),
        ("capacity", "auto", "fixed", None, CAP, "does not mask positions"),
        ("capacity", "auto", "conf", "/tmp/depth", CAP, "VLLM_DSPARK_DEPTH_FILE"),
        ("capacity", "auto", "conf", None, None, "no dynamic speculation schedule"),
        ("capacity", "auto", "conf", None, [], "no dynamic speculation schedule"),
        ("resilience", "auto", "conf", None, [0, 5, 7, 5], "never caps below N"),
    ],
    ids=["shadow", "n_out-0", "non-masking-mode", "depth-file", "no-schedule", "empty-schedule", "never-caps"],
)
def test_n_out_none(policy, n_out, mode, depth_file, cap, reason):
    cfg = cfg_of(POLICY=policy, N_OUT=n_out)
    table, why = n_out_table(cfg, 5, mode, depth_file, cap)
    assert table is None and reason in why


@pytest.mark.parametrize("mode", CAP_MASKING_DEPTH_MODES)
def test_n_out_table_caps_by_request_count(mode):
    table, why = n_out_table(cfg_of(POLICY="capacity"), 5, mode, None, [3, 5, 4, 2, 9])
    assert table == [0, 5, 4, 2, 5] and why == "cap by request count"


@pytest.mark.parametrize("var", ["TIMEOUT_MS", "CONNECT_TIMEOUT_MS", "BACKOFF_MAX_MS", "ASYNC_WATCHDOG_MS"])
def test_durations_must_fit_32_bits(var):
    raw = str(2**31)
    with pytest.raises(ValueError) as e:
        cfg_of(**{var: raw, "BACKOFF_MS": "1"})
    assert P + var in str(e.value) and raw in str(e.value) and "<= 2147483647" in str(e.value)
