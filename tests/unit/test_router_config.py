"""router.yaml: round trips, both kinds of discovery, clear errors for bad files, and its
reference page (docs/router-config.md) kept true."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from ddm.deploy.limits import (MAX_CONTEXT_CACHE_BYTES, ROUTER_CLIENT_ROW_STEPS,
                               ROUTER_CLIENT_ROW_STEPS_PER_S, ROUTER_MAX_CONCURRENT_PER_CLIENT)
from ddm.deploy.router_config import (
    Auth,
    Coalescing,
    DnsDiscovery,
    ExpertEntry,
    MissingExpert,
    RouterConfigError,
    RouterConfigFile,
    RouterLimits,
    Retries,
    SamplingDefaults,
    StaticDiscovery,
    Timeouts,
)
from ddm.serving.router.fleet.servers import pool_settings
from ddm.serving.router.api.state import load_router_config

TEXT = """\
num_classes: 10
sampling: {steps: 20, solver: heun, strategy: top1}
router_checkpoint: /models/router
experts:
- name: low
  classes: [0, 1, 2, 3, 4]
  discovery: {dns: d-expert-low.ns.svc.cluster.local, port: 8000}
- name: high
  classes: [5, 6, 7, 8, 9]
  discovery: {endpoints: ["127.0.0.1:8001", "[::1]:8002"]}
timeouts: {connect_s: 1.5, request_s: 10}
retries: {attempts: 3, backoff_s: 0.1}
dns_refresh_s: 2
"""


def test_a_file_with_both_kinds_of_discovery() -> None:
    config = RouterConfigFile.from_yaml(TEXT)
    low, high = config.experts
    assert low.discovery == DnsDiscovery(dns="d-expert-low.ns.svc.cluster.local", port=8000)
    assert high.discovery == StaticDiscovery(endpoints=("127.0.0.1:8001", "[::1]:8002"))
    assert config.sampling == SamplingDefaults(steps=20, solver="heun", strategy="top1")
    assert (config.timeouts.connect_s, config.retries.attempts, config.dns_refresh_s) == (
        1.5, 3, 2)
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_defaults() -> None:
    config = RouterConfigFile(experts=(ExpertEntry("a", DnsDiscovery("a.svc", 8000)),),
                              router_checkpoint="/r")
    assert config.sampling == SamplingDefaults() and config.num_classes == 10
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


@pytest.mark.parametrize("change, message", [
    (lambda t: t.replace("dns_refresh_s", "dns_refresh"), "unknown keys ['dns_refresh']"),
    (lambda t: t.replace("solver: heun", "solver: rk4"), "sampling.solver must be one of"),
    (lambda t: t.replace("strategy: top1", "strategy: best"), "sampling.strategy 'best'"),
    (lambda t: t.replace("port: 8000", "port: 0"), "discovery.port must be in 1..65535"),
    (lambda t: t.replace("port: 8000", "prt: 8000"), "unknown keys ['prt']"),
    (lambda t: t.replace("port: 8000", "port: 8000, 1: 2, x: 3"), "unknown keys [1, 'x']"),
    (lambda t: t.replace('"127.0.0.1:8001"', '"127.0.0.1"'), "'127.0.0.1' is not host:port"),
    (lambda t: t.replace('"[::1]:8002"', '"::1:8002"'),
     "'::1:8002': an IPv6 address needs brackets, as in [::1]:8000"),
    (lambda t: t.replace("name: high", "name: low"), "expert names must be unique"),
    (lambda t: t.replace("[5, 6, 7, 8, 9]", "[5, 10]"), "classes [10] are outside 0..9"),
    (lambda t: t.replace("router_checkpoint: /models/router\n", ""),
     "strategy top1 needs router_checkpoint"),
    (lambda t: t.replace("attempts: 3", "attempts: 0"), "retries.attempts must be"),
    (lambda t: t.replace("dns: d-expert-low.ns.svc.cluster.local, port: 8000",
                         "dns: d-expert-low.ns.svc.cluster.local"), "discovery needs port"),
    (lambda t: t.replace("num_classes: 10", "num_classes: [10"), "not valid YAML"),
    (lambda t: t + "dns_refresh_s: 5\n",
     "found duplicate key 'dns_refresh_s' (first on line 13)"),
])
def test_bad_files_are_rejected_with_the_key(change, message: str) -> None:
    with pytest.raises(RouterConfigError) as caught:
        RouterConfigFile.from_yaml(change(TEXT))
    assert message in str(caught.value)


def test_a_file_that_is_not_text_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(RouterConfigError) as caught:
        load_router_config(path)
    assert f'in "{path}", position 0' in str(caught.value)


def test_the_oracle_needs_no_router_checkpoint() -> None:
    text = TEXT.replace("router_checkpoint: /models/router\n", "").replace("top1", "oracle")
    assert RouterConfigFile.from_yaml(text).router_checkpoint is None


def test_limits_and_auth_round_trip() -> None:
    text = TEXT + ("limits: {max_batch: 8, max_steps: 50, max_concurrent: 4, "
                   "max_body_bytes: 4096}\n"
                   "auth: {token_file: /var/run/secrets/ddm/router-token/token}\n")
    config = RouterConfigFile.from_yaml(text)
    assert config.limits == RouterLimits(max_batch=8, max_steps=50, max_concurrent=4,
                                         max_body_bytes=4096)
    assert config.auth == Auth(token_file="/var/run/secrets/ddm/router-token/token")
    assert config.auth.expert_token == config.auth.token_file  # written before the split
    assert "expert_token_file" not in config.to_yaml()
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_the_routers_context_store_is_a_setting_within_its_bounds() -> None:
    config = RouterConfigFile.from_yaml(TEXT + "limits: {context_cache_bytes: 1048576}\n")
    assert config.limits.context_cache_bytes == 1048576
    assert pool_settings(config).context_cache_bytes == 1048576  # what the pool keeps
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config
    assert RouterConfigFile.from_yaml(TEXT).limits.context_cache_bytes == 256 * 1024 * 1024
    for bad in (0, MAX_CONTEXT_CACHE_BYTES + 1, "1GB"):
        with pytest.raises(RouterConfigError, match=(
                rf"limits.context_cache_bytes must be an integer in 1..{MAX_CONTEXT_CACHE_BYTES}"
                rf", got {bad!r}")):
            RouterConfigFile.from_yaml(TEXT + f"limits: {{context_cache_bytes: {bad}}}\n")


def test_the_router_presents_its_expert_token_not_the_public_one() -> None:
    config = RouterConfigFile.from_yaml(TEXT + "auth: {token_file: /t/public, "
                                               "expert_token_file: /t/experts}\n")
    assert config.auth.expert_token == "/t/experts"
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_without_auth_the_file_has_no_auth_key_and_limits_have_safe_defaults() -> None:
    config = RouterConfigFile.from_yaml(TEXT)
    assert config.auth is None and "auth" not in config.to_yaml()
    assert config.limits == RouterLimits()
    assert RouterConfigFile.from_yaml(TEXT + "auth: null\n").auth is None


def test_the_per_client_limit_and_trusted_proxies_round_trip_with_safe_defaults() -> None:
    default = RouterConfigFile.from_yaml(TEXT)
    assert default.limits.max_concurrent_per_client == ROUTER_MAX_CONCURRENT_PER_CLIENT
    assert ROUTER_MAX_CONCURRENT_PER_CLIENT < default.limits.max_concurrent
    assert default.trusted_proxies == () and default.trusted_networks() == ()
    config = RouterConfigFile.from_yaml(
        TEXT + "limits: {max_concurrent_per_client: 2}\n"
               "trusted_proxies: [10.0.0.0/24, 'fd00::/64', 192.0.2.7]\n")
    assert config.limits.max_concurrent_per_client == 2
    assert [str(n) for n in config.trusted_networks()] == ["10.0.0.0/24", "fd00::/64",
                                                            "192.0.2.7/32"]
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_a_clients_budget_defaults_to_four_of_the_largest_generations_and_round_trips() -> None:
    limits = RouterConfigFile.from_yaml(TEXT).limits
    assert (limits.client_row_steps, limits.client_row_steps_per_s) == (
        ROUTER_CLIENT_ROW_STEPS, ROUTER_CLIENT_ROW_STEPS_PER_S)
    largest = limits.max_batch * limits.max_steps * 2  # guided rows count twice
    assert limits.client_row_steps == limits.max_concurrent_per_client * largest
    config = RouterConfigFile.from_yaml(
        TEXT + "limits: {client_row_steps: 500, client_row_steps_per_s: 0.5}\n")
    assert (config.limits.client_row_steps, config.limits.client_row_steps_per_s) == (500, 0.5)
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_coalescing_defaults_to_two_requests_per_replica_and_zero_turns_it_off() -> None:
    assert RouterConfigFile.from_yaml(TEXT).coalescing == Coalescing(in_flight_per_replica=2)
    config = RouterConfigFile.from_yaml(TEXT + "coalescing: {in_flight_per_replica: 0}\n")
    assert config.coalescing.in_flight_per_replica == 0
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_a_missing_expert_fails_by_default_and_the_policy_round_trips() -> None:
    assert RouterConfigFile.from_yaml(TEXT).missing_expert == MissingExpert("fail", 120.0)
    config = RouterConfigFile.from_yaml(TEXT + "missing_expert: {policy: wait, wait_s: 5}\n")
    assert config.missing_expert == MissingExpert("wait", 5)
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config


def test_the_allowed_strategies_round_trip_and_hold_the_default() -> None:
    config = RouterConfigFile.from_yaml(TEXT.replace(
        "strategy: top1}", "strategy: top1, strategies: [topk:1, top2, 'threshold:.50']}"))
    assert config.sampling.strategies == ("topk:1", "top2", "threshold:.50")
    assert RouterConfigFile.from_yaml(config.to_yaml()) == config
    assert RouterConfigFile.from_yaml(TEXT).sampling.strategies == ()  # any


@pytest.mark.parametrize("strategies, message", [
    ("[top2, ensemble]", "sampling.strategy top1 is not among sampling.strategies "
                         "['top2', 'ensemble']"),
    ("[top1, all]", "sampling.strategies must be a list of strategies"),
    ("top1", "sampling.strategies must be a list of strategies"),
])
def test_bad_strategies_are_refused_naming_the_key(strategies: str, message: str) -> None:
    with pytest.raises(RouterConfigError, match=re.escape(message)):
        RouterConfigFile.from_yaml(TEXT.replace("strategy: top1}",
                                                f"strategy: top1, strategies: {strategies}}}"))


@pytest.mark.parametrize("extra, message", [
    ("auth: {}\n", "auth needs token_file"),
    ("auth: {token_file: ''}\n", "auth.token_file must be a file path"),
    ("auth: {token_file: /t, expert_token_file: 3}\n",
     "auth.expert_token_file must be a file path, got 3"),
    ("auth: {token: secret}\n", "auth has unknown keys ['token']"),
    ("limits: {max_concurrent: 0}\n", "limits.max_concurrent must be an integer >= 1"),
    ("limits: {max_steps: 10}\n", "sampling.steps 20 exceeds limits.max_steps 10"),
    ("limits: {max_steps: 5000}\n", "limits.max_steps must be at most 1000"),
    ("limits: {max_body: 10}\n", "limits has unknown keys ['max_body']"),
    ("coalescing: {in_flight_per_replica: -1}\n",
     "coalescing.in_flight_per_replica must be an integer >= 0, got -1"),
    ("coalescing: {in_flight: 2}\n", "coalescing has unknown keys ['in_flight']"),
    ("limits: {max_concurrent_per_client: 0}\n",
     "limits.max_concurrent_per_client must be an integer >= 1, got 0"),
    ("limits: {client_row_steps: 0}\n",
     "limits.client_row_steps must be an integer >= 1, got 0"),
    ("limits: {client_row_steps_per_s: 0}\n",
     "limits.client_row_steps_per_s must be a number > 0, got 0"),
    ("limits: {client_row_steps_per_s: .inf}\n",
     "limits.client_row_steps_per_s must be a number > 0, got inf"),
    ("missing_expert: {policy: hope}\n",
     "missing_expert.policy must be one of ['fail', 'wait', 'reroute'], got 'hope'"),
    ("missing_expert: {wait_s: 0}\n", "missing_expert.wait_s must be in (0, 3600], got 0"),
    ("missing_expert: {wait: 3}\n", "missing_expert has unknown keys ['wait']"),
    ("trusted_proxies: 10.0.0.0/8\n", "trusted_proxies must be a list of CIDRs"),
    ("trusted_proxies: [10.0.0.1/8]\n", "trusted_proxies: network '10.0.0.1/8' is not an "
                                         "address or a CIDR"),
])
def test_bad_limits_and_auth_are_rejected_with_the_key(extra: str, message: str) -> None:
    with pytest.raises(RouterConfigError) as caught:
        RouterConfigFile.from_yaml(TEXT + extra)
    assert message in str(caught.value)


# ------------------------------------------------------------------ docs/router-config.md

DOC = Path(__file__).resolve().parents[2] / "docs" / "router-config.md"


def _key_paths(cls: type, prefix: str = "") -> set[str]:
    """Every key ``router.yaml`` accepts, as the documentation writes it."""
    nested = {"experts": (ExpertEntry,), "discovery": (StaticDiscovery, DnsDiscovery)}
    paths = set()
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        paths.add(path)
        kinds = nested.get(f.name) or tuple(
            k for k in (SamplingDefaults, Timeouts, Retries, RouterLimits, Coalescing,
                      MissingExpert, Auth)
            if f.type in (k.__name__, f"{k.__name__} | None"))
        for kind in kinds:
            inner = f"{path}[]." if f.name == "experts" else f"{path}."
            paths |= _key_paths(kind, inner)
        if f.type == "StageEntry | None":  # {checkpoint, precision} or a discovery, inline
            paths |= {f"{path}.{key}" for key in ("checkpoint", "precision", "endpoints",
                                                   "dns", "port", "member")}
    return paths


def test_the_documentation_lists_exactly_the_keys_and_its_example_parses() -> None:
    text = DOC.read_text()
    documented = set(re.findall(r"^\| `([a-z_\[\].]+)` \|", text, re.MULTILINE))
    paths = _key_paths(RouterConfigFile)
    leaves = {p for p in paths if not any(q.startswith(f"{p}.") or q.startswith(f"{p}[]")
                                          for q in paths)}
    assert documented == leaves | {"experts"}
    example = re.search(r"```yaml\n(.*?)```", text, re.DOTALL).group(1)
    config = RouterConfigFile.from_yaml(example)
    assert config.coalescing.in_flight_per_replica == 2 and config.auth is not None
    assert isinstance(config.experts[1].discovery, DnsDiscovery)


# ------------------------------------------------------------------ pool members

def _with_members(expert: dict, stage: dict) -> dict:
    return {"experts": [{"name": "e0", "discovery": expert}], "conditioning": "text",
            "text_encoder": stage, "sampling": {"strategy": "oracle"}}


def test_a_discovery_names_a_pool_member_and_writes_it_back_only_when_given() -> None:
    config = RouterConfigFile.from_dict(_with_members(
        {"endpoints": ["127.0.0.1:9000"], "member": "e0"},
        {"dns": "pool.ml.svc", "port": 8000, "member": "text-encoder"}))
    assert config.experts[0].discovery == StaticDiscovery(("127.0.0.1:9000",), "e0")
    assert config.text_encoder.discovery == DnsDiscovery("pool.ml.svc", 8000, "text-encoder")
    again = RouterConfigFile.from_yaml(config.to_yaml())
    assert again == config
    plain = RouterConfigFile.from_dict(_with_members({"endpoints": ["127.0.0.1:9000"]},
                                                     {"endpoints": ["127.0.0.1:9001"]}))
    assert "member" not in plain.to_dict()["experts"][0]["discovery"]
    assert "member" not in plain.to_dict()["text_encoder"]


@pytest.mark.parametrize("member", ["", "Expert_0", "a/b", 3])
def test_a_member_that_is_not_a_name_is_refused_naming_the_field(member) -> None:
    with pytest.raises(RouterConfigError, match="discovery.member must be a pool member's name"):
        RouterConfigFile.from_dict(_with_members(
            {"endpoints": ["127.0.0.1:9000"], "member": member},
            {"endpoints": ["127.0.0.1:9001"]}))
