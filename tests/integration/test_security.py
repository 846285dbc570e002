"""Token authentication and (mutual) TLS on real tasks: refused calls change nothing."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from psserver.client import PSClient
from psserver.contract import PROTOCOL_VERSION
from psserver.errors import PSError, Unauthenticated, Unavailable
from psserver.tls import TLSConfig, generate_self_signed

pytestmark = pytest.mark.timeout(60)

TOKEN = "cluster-secret"


@pytest.fixture
def secured(start_ps, tmp_path):
    """A psserver with a token and mutual TLS, and a variable on it."""
    tls = generate_self_signed(str(tmp_path / "good"))
    ps = start_ps(env={"PSTRAIN_AUTH_TOKEN": TOKEN, **tls.env()})
    with PSClient(ps.address, token=TOKEN, tls=tls, timeout=10) as good:
        good.create_variable("w", initial_value=np.arange(4, dtype=np.float32))
        yield ps, tls, good


def _unchanged(good: PSClient) -> None:
    value, version = good.read("w", with_version=True)
    np.testing.assert_array_equal(value, np.arange(4, dtype=np.float32))
    assert version == 0


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + " "])
def test_missing_or_wrong_token_is_refused(secured, token, monkeypatch):
    monkeypatch.delenv("PSTRAIN_AUTH_TOKEN", raising=False)   # else token=None takes it
    ps, tls, good = secured
    with PSClient(ps.address, token=token, tls=tls, timeout=10) as c:
        with pytest.raises(Unauthenticated, match="token"):
            c.push("w", np.ones(4, np.float32))
        with pytest.raises(Unauthenticated):
            c.read("w")
    _unchanged(good)


def test_client_without_a_token_takes_the_environments(start_ps, monkeypatch):
    ps = start_ps(env={"PSTRAIN_AUTH_TOKEN": TOKEN})
    monkeypatch.setenv("PSTRAIN_AUTH_TOKEN", TOKEN)
    with PSClient(ps.address, timeout=10) as c:
        c.create_variable("w", initial_value=np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(c.read("w"), np.arange(4, dtype=np.float32))
    monkeypatch.delenv("PSTRAIN_AUTH_TOKEN")
    with PSClient(ps.address, timeout=10) as c:
        with pytest.raises(Unauthenticated, match="PSTRAIN_AUTH_TOKEN"):
            c.read("w")


def test_client_that_does_not_trust_the_server_certificate_is_refused(secured, tmp_path):
    ps, tls, good = secured
    other = generate_self_signed(str(tmp_path / "other"))   # another CA, another identity
    with PSClient(ps.address, token=TOKEN, tls=other, timeout=5) as c:
        with pytest.raises(Unavailable):
            c.push("w", np.ones(4, np.float32))
    _unchanged(good)


def test_client_without_a_certificate_is_refused_by_mutual_tls(secured):
    ps, tls, good = secured
    ca_only = dataclasses.replace(tls, cert=None, key=None)   # trusts the server, no identity
    with PSClient(ps.address, token=TOKEN, tls=ca_only, timeout=5) as c:
        with pytest.raises(Unavailable):
            c.push("w", np.ones(4, np.float32))
    _unchanged(good)


def test_plaintext_client_is_refused(secured):
    ps, tls, good = secured
    with PSClient(ps.address, token=TOKEN, timeout=5) as c:
        with pytest.raises(PSError):
            c.push("w", np.ones(4, np.float32))
    _unchanged(good)
    assert good.push("w", np.ones(4, np.float32)) == 1   # the right client still works


def test_half_a_key_pair_is_a_clear_error(tmp_path):
    tls = generate_self_signed(str(tmp_path))
    with pytest.raises(ValueError, match="both"):
        TLSConfig.from_files(tls.paths[0], None, None)


@pytest.mark.parametrize("theirs, older", [("0", "the client is older"),
                                           ("99", "this server is older")])
def test_protocol_version_mismatch_names_the_older_side(ps, theirs, older):
    import grpc

    from protos.pstrain.v1 import ps_pb2, ps_pb2_grpc
    with grpc.insecure_channel(ps.address) as ch:
        stub = ps_pb2_grpc.ParameterServerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListVariables(ps_pb2.ListRequest(), metadata=(("x-pstrain-protocol", theirs),),
                               timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert older in info.value.details() and "protocol version mismatch" in info.value.details()
        # The current client announces the same version and is served.
        stub.ListVariables(ps_pb2.ListRequest(),
                           metadata=(("x-pstrain-protocol", str(PROTOCOL_VERSION)),), timeout=10)
    with PSClient(ps.address) as c:
        assert c.list_variables() == []


# -- files: checkpoints only where the operator said -----------------------------------------------
def test_save_writes_only_under_the_checkpoint_dirs(start_ps, tmp_path):
    """A token holder's Save names any path: it is confined to --checkpoint-dir
    (symbolic links and .. resolved first); outside it nothing is written. A
    server without --checkpoint-dir writes nothing at all."""
    from psserver.errors import PermissionDenied

    allowed, elsewhere = tmp_path / "ckpt", tmp_path / "etc"
    (allowed / "run1").mkdir(parents=True)
    elsewhere.mkdir()
    (allowed / "escape").symlink_to(elsewhere)
    ps = start_ps("--checkpoint-dir", str(allowed), env={"PSTRAIN_AUTH_TOKEN": TOKEN})
    bare = start_ps(env={"PSTRAIN_AUTH_TOKEN": TOKEN})
    with PSClient(ps.address, token=TOKEN) as c, PSClient(bare.address, token=TOKEN) as b:
        for client in (c, b):
            client.create_variable("w", initial_value=np.arange(4, dtype=np.float32))
        (saved,) = c.save(str(allowed / "run1"), ["w"])
        assert (allowed / "run1" / saved.file).exists()
        c.create_table("t", 2)
        for where in (elsewhere, allowed / "escape", allowed / ".." / "etc", "/"):
            with pytest.raises(PermissionDenied, match="--checkpoint-dir"):
                c.save(str(where), ["w"])
            with pytest.raises(PermissionDenied, match="--checkpoint-dir"):   # incremental
                c.save_incremental(str(where), ["w"], save_id=5, stream="s", weights_only=True)
            with pytest.raises(PermissionDenied, match="--checkpoint-dir"):
                c.save_table("t", str(where), save_id=6, stream="s")
        with pytest.raises(PermissionDenied, match="started without --checkpoint-dir"):
            b.save(str(allowed / "run1"), ["w"])
    assert list(elsewhere.iterdir()) == []
    assert [p.name for p in (allowed / "run1").iterdir()] == [saved.file]


@pytest.mark.timeout(120)
def test_a_directory_swapped_for_a_link_during_saves_gets_nothing_written_outside(start_ps,
                                                                                  tmp_path):
    """Issue 33 item 4: a part of the save's path swapped for a link to a
    directory outside --checkpoint-dir, over and over while a variable and
    a table are saved there (the probe wrote outside after 46 tries): every
    save lands in a directory under --checkpoint-dir or is refused."""
    import threading

    from psserver.errors import InvalidArgument, PermissionDenied
    allowed, outside = tmp_path / "ckpt", tmp_path / "outside"
    (allowed / "run").mkdir(parents=True)
    outside.mkdir()
    ps = start_ps("--checkpoint-dir", str(allowed))
    stop = threading.Event()

    def swapper():   # run <-> a link to outside, as fast as it goes
        n = 0
        while not stop.is_set():
            n += 1
            os.rename(allowed / "run", allowed / f"real-{n}")
            os.symlink(outside, allowed / "run")
            os.unlink(allowed / "run")
            os.rename(allowed / f"real-{n}", allowed / "run")
    with PSClient(ps.address) as c:
        c.create_variable("w", initial_value=np.arange(4, dtype=np.float32))
        c.create_table("t", 2)
        c.lookup("t", [1, 2, 3])
        thread = threading.Thread(target=swapper, daemon=True)
        thread.start()
        saved = refused = 0
        try:
            for i in range(150):
                try:
                    if i % 2:
                        c.save(str(allowed / "run"), ["w"])
                    else:
                        c.save_table("t", str(allowed / "run"))
                    saved += 1
                except (PermissionDenied, InvalidArgument):
                    refused += 1
        finally:
            stop.set()
            thread.join(10)
    assert list(outside.iterdir()) == [], list(outside.iterdir())
    assert saved + refused == 150 and saved, (saved, refused)


def test_a_killed_local_cluster_leaves_no_private_key_behind(tmp_path):
    """SIGKILL runs no cleanup: the next LocalCluster removes what a dead
    one left (its CA and key), and keeps a live one's."""
    import signal
    import subprocess
    import sys

    from coordinator import LocalCluster
    from psserver.process import child_env

    script = ("from coordinator import LocalCluster\n"
              "c = LocalCluster(num_ps=1, num_workers=0)\n"
              "print(c._tls_dir, flush=True)\n"
              "import time; time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=child_env(),
                            stdout=subprocess.PIPE, text=True)
    try:
        dead_dir = proc.stdout.readline().strip()
        assert os.path.exists(os.path.join(dead_dir, "ca.key")) or os.listdir(dead_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        with LocalCluster(num_ps=1, num_workers=0) as cluster:
            assert not os.path.exists(dead_dir)
            assert os.path.isdir(cluster._tls_dir)
            assert oct(os.stat(os.path.dirname(cluster._tls_dir)).st_mode & 0o777) == "0o700"
        assert not os.path.exists(cluster._tls_dir)
    finally:
        proc.kill()
        proc.wait()


def test_saves_write_through_temporary_names_of_their_own(start_ps, tmp_path):
    """The temporary file was "<file>.tmp<server pid>": the same for every
    thread (two concurrent saves of one shard into one directory raced,
    INTERNAL) and known in advance (whatever was planted there broke or
    took the save). Each write now has its own, made exclusively; a write
    that fails is a clear error, not INTERNAL."""
    from concurrent import futures

    from safetensors.numpy import load_file

    from psserver.errors import FailedPrecondition

    d = tmp_path / "ckpt"
    d.mkdir()
    ps = start_ps("--checkpoint-dir", str(d), env={"PSTRAIN_AUTH_TOKEN": TOKEN})
    value = np.arange(1 << 20, dtype=np.float32)   # 4 MiB: a write takes a while
    with PSClient(ps.address, token=TOKEN, timeout=60) as c:
        c.create_variable("w", initial_value=value)
        c.create_table("t", 2)
        planted = [d / f"w.safetensors.tmp{ps.pid}", d / f"~table~t.safetensors.tmp{ps.pid}"]
        for p in planted:   # where the old names were: in the way
            p.mkdir()
        (saved,) = c.save(str(d), ["w"])
        assert c.save_table("t", str(d)).rows == 0
        with futures.ThreadPoolExecutor(4) as pool:   # one shard, one directory, at once
            jobs = [pool.submit(c.save, str(d), ["w"]) for _ in range(12)]
            assert all(j.result()[0].file == saved.file for j in jobs)
        (d / "sub" / "w.safetensors").mkdir(parents=True)   # a directory where the file goes
        with pytest.raises(FailedPrecondition, match="cannot write checkpoint file"):
            c.save(str(d / "sub"), ["w"])
    np.testing.assert_array_equal(load_file(d / saved.file)["value"], value)
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [saved.file, "~table~t.safetensors", "sub"] + [p.name for p in planted])
    assert [p.name for p in (d / "sub").iterdir()] == ["w.safetensors"]
