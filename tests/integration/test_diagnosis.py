"""A task that cannot be reached is named with what to check, by every
caller alike (issue 35, items 4 and 11): PSClient, `coordinator health`,
`coordinator ps health`, `coordinator run`'s wait, and the coordinator's
worker threads. Real tasks on 127.0.0.1; TLS from a throwaway CA.
"""
from __future__ import annotations

import json
import logging
import re
import socket
import time

import numpy as np
import pytest

from coordinator import ClusterCoordinator, ParameterServerStrategy, cli
from coordinator.cluster_spec import ClusterSpec
from psserver.client import PSClient
from psserver.errors import Unavailable
from psserver.process import start_task
from psserver.tls import CA_ENV, CERT_ENV, KEY_ENV

pytestmark = pytest.mark.timeout(60)

TLS_ENV = (CERT_ENV, KEY_ENV, CA_ENV)


def free_address() -> str:
    """An address nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def tls(tmp_path):
    pytest.importorskip("cryptography", reason="cryptography is not installed")
    from psserver.tls import generate_self_signed
    return generate_self_signed(str(tmp_path / "tls"))


@pytest.fixture
def no_tls_env(monkeypatch):
    for k in (*TLS_ENV, "TF_CONFIG", "TF_CONFIG_FILE", "PSTRAIN_AUTH_TOKEN"):
        monkeypatch.delenv(k, raising=False)


def set_tls_env(monkeypatch, tls) -> None:
    for k, v in tls.env().items():
        monkeypatch.setenv(k, v)


def mismatch_advice(text: str) -> str:
    """The diagnosis of a TLS mismatch in ``text``: from "most likely" to the line's end."""
    found = re.search(r"most likely a TLS mismatch: [^\n]*?(?= \[|$)", text, re.M)
    assert found, text
    return found.group(0)


# -- item 4: PSClient takes TLS from the environment, and says why it cannot connect -------------
def test_a_client_takes_tls_from_the_environment_like_the_token(start_ps, tls, no_tls_env,
                                                                monkeypatch):
    ps = start_ps(env=tls.env())
    set_tls_env(monkeypatch, tls)
    with PSClient(ps.address) as c:   # no tls=: $PSTRAIN_TLS_* as the tasks take them
        c.create_variable("w", initial_value=np.arange(3, dtype=np.float32))
        np.testing.assert_array_equal(c.read("w"), [0, 1, 2])
    with pytest.raises(Unavailable) as err:   # an explicit argument wins: tls=False
        PSClient(ps.address, tls=False).server_info()
    assert "TLS mismatch" in str(err.value) and "speaks plaintext" in str(err.value)


def test_a_plaintext_client_of_a_tls_server_names_the_mismatch(start_ps, tls, no_tls_env):
    ps = start_ps(env=tls.env())
    with PSClient(ps.address) as c, pytest.raises(Unavailable) as err:
        c.server_info()
    message = str(err.value)
    assert f"parameter server at {ps.address} accepts connections" in message, message
    assert "most likely a TLS mismatch: this client speaks plaintext" in message
    assert f"set ${CA_ENV}" in message and f"${CERT_ENV} / ${KEY_ENV}" in message


def test_a_tls_client_of_a_plaintext_server_names_the_mismatch(start_ps, tls, no_tls_env,
                                                              monkeypatch):
    ps = start_ps()
    set_tls_env(monkeypatch, tls)
    with PSClient(ps.address) as c, pytest.raises(Unavailable) as err:
        c.server_info()
    message = str(err.value)
    assert "most likely a TLS mismatch: this client speaks TLS" in message, message
    assert "unset all three if the tasks run plaintext" in message


def test_a_client_of_a_port_nobody_listens_on_says_what_to_check(no_tls_env):
    dead = free_address()
    with PSClient(dead) as c, pytest.raises(Unavailable) as err:
        c.list_variables()
    message = str(err.value)
    assert f"nothing answers at {dead}" in message, message
    assert "check that its psserver is running there" in message and "firewall" in message


def test_bad_tls_settings_in_the_environment_say_which_and_what_to_do(no_tls_env, monkeypatch):
    monkeypatch.setenv(CERT_ENV, "/nonexistent/tls.crt")   # no key: half a pair
    with pytest.raises(ValueError) as err:
        PSClient("127.0.0.1:1")
    assert f"${CERT_ENV}" in str(err.value) and "tls=" in str(err.value)
    with pytest.raises(TypeError, match="TLSConfig"):
        PSClient("127.0.0.1:1", tls="yes")


# -- item 4: every command says the same ----------------------------------------------------------
def test_coordinator_health_names_a_tls_mismatch_as_ps_health_does(start_ps, tls, no_tls_env,
                                                                   capsys):
    ps = start_ps(env=tls.env())
    assert cli.main(["health", "--timeout", "5", ps.address]) == 1
    health = capsys.readouterr().err
    assert f"{ps.address}: UNAVAILABLE: " in health
    assert "accepts connections but the gRPC handshake fails" in health, health
    assert cli.main(["ps", "health", "--ps", ps.address, "--timeout", "5"]) == 1
    ps_health = capsys.readouterr().err
    assert mismatch_advice(health) == mismatch_advice(ps_health)
    assert "this command speaks plaintext" in mismatch_advice(health)


def test_coordinator_health_of_a_port_nobody_listens_on_says_what_to_check(no_tls_env, capsys):
    dead = free_address()
    assert cli.main(["health", "--timeout", "2", dead]) == 1
    err = capsys.readouterr().err
    assert f"nothing answers at {dead}" in err and "is running there" in err, err


def test_run_names_a_tls_mismatch_when_the_tasks_do_not_come_up(start_ps, tls, no_tls_env,
                                                               monkeypatch, capsys, tmp_path):
    ps = start_ps(env=tls.env())
    worker = free_address()
    script = tmp_path / "train.py"
    script.write_text("print('TRAINED')\n")
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"ps": [ps.address],
                                                            "worker": [worker]}}))
    assert cli.main(["run", "--wait-ready", "1", str(script)]) == cli.EXIT_NOT_READY
    out = capsys.readouterr()
    assert "TRAINED" not in out.out
    assert f"ps 0 at {ps.address}: UNAVAILABLE: " in out.err, out.err
    assert "most likely a TLS mismatch: this command speaks plaintext" in out.err
    assert f"worker 0 at {worker}: UNAVAILABLE: nothing answers at {worker}" in out.err
    assert "check that its psworker is running there" in out.err


# -- item 11: a worker whose port refuses connections is named at once -----------------------------
def test_a_worker_on_a_port_nobody_listens_on_is_named_before_a_short_job_ends(
        start_ps, no_tls_env, caplog):
    """The job runs on the good worker and ends well within connect_timeout
    (10 s): the warning about the other worker is there by then."""
    token = {"PSTRAIN_AUTH_TOKEN": "t0ken"}
    ps = start_ps(env=token)
    good = start_task("psworker", ["--port", "0"], env=token)
    dead = free_address()
    try:
        strategy = ParameterServerStrategy(ClusterSpec(ps=[ps.address],
                                                       worker=[good.address, dead]),
                                           token="t0ken")
        assert strategy.connect_timeout >= 10
        caplog.set_level(logging.WARNING, logger="coordinator")
        with ClusterCoordinator(strategy) as coord:
            values = [coord.schedule(time.sleep, args=(0.4,)) for _ in range(8)]
            coord.join()
            assert all(v.fetch() is None for v in values)
        warnings = [r.getMessage() for r in caplog.records if dead in r.getMessage()]
        assert warnings, caplog.text
        assert len(warnings) == 1, warnings   # once per worker
        assert warnings[0].startswith(f"worker 1 at {dead} does not answer (its first call "
                                      "failed; a TCP connection: ")
        assert "check that its psworker is running there" in warnings[0]
        assert warnings[0].endswith("still waiting for it")
    finally:
        good.kill()
