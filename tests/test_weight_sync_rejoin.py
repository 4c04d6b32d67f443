"""Engines that come back get the current policy: real built-in engine processes (`python -m rollout_fleet.engine`)
and the learner's publisher in this process (one rank, the same code as rank 0 of FSDP2).

- An engine killed and restarted on the same URL serves its initial weights (label "0"): before the next sync
  the sender sees that its label is not the one it was given, rebuilds the group with it, and that one sync
  brings it to the learner's weights. Nothing waits on a timeout.
- An engine that was dead at a sync is quarantined; once it answers again it rejoins at the next sync.
- A fresh sender (a learner that restarted without closing its group) joins engines that still hold the old
  group of that name.
- The publisher does not let a version be announced when no engine got it, asks for a resync as soon as an
  engine is back, and announces once it reached the whole pool.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch

from broker.server import free_port
from learner.publish import WeightSyncPublisher
from tests.test_engine_weight_sync import start_engine, wait_ready
from tests.test_weight_sync_e2e import _train_step, http_json
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import weights_checksum
from weight_sync.sender import WeightSender, sync_weights

pytestmark = pytest.mark.timeout(300)
TIMEOUT_S = 20.0


class Engines:
    """Built-in engine processes on fixed ports, restartable on the same port."""

    def __init__(self, model_dir: Path, count: int, run_dir: Path) -> None:
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.ports = [free_port() for _ in range(count)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * count

    def start(self, i: int) -> None:
        self.procs[i] = start_engine(self.model_dir, self.ports[i], self.run_dir)

    def wait(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        wait_ready(self.urls[i], proc)

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def label(self, i: int) -> str:
        return http_json(self.urls[i] + "/model_info")["weight_version"]

    def checksum(self, i: int) -> str:
        return http_json(self.urls[i] + "/weights_checker", {"action": "checksum"})["checksum"]


@pytest.fixture
def engines(tmp_path: Path):
    from rollout_fleet.model import init_tiny_model

    fleet = Engines(init_tiny_model(tmp_path / "tiny"), 2, tmp_path / "run")
    try:  # an engine that never answers still leaves no process behind
        for i in range(2):
            fleet.start(i)
        for i in range(2):
            fleet.wait(i)
        yield fleet
    finally:
        for i in range(2):
            fleet.kill(i)


def learner_model(model_dir: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def truth(model: torch.nn.Module) -> str:
    return weights_checksum([(n, p.detach()) for n, p in model.named_parameters()])


CONFIG = WeightSyncConfig(bucket_mb=0.25, timeout_s=TIMEOUT_S, master_address="127.0.0.1", pause_mode="abort")


def test_a_restarted_or_returning_engine_gets_the_current_weights(engines: Engines) -> None:
    model, opt = learner_model(engines.model_dir)
    sender = WeightSender(engines.urls, CONFIG)
    assert sender.connect() == {}
    _train_step(model, opt, seed=0)
    first = sync_weights(model, 1, sender)
    assert first is not None and first.engines_ok == engines.urls
    assert [engines.label(i) for i in range(2)] == ["1", "1"]

    # kill -9 and restart on the same URL: it serves the initial weights, labelled "0"
    engines.kill(1)
    engines.start(1)
    engines.wait(1)
    assert engines.label(1) == "0" and engines.checksum(1) != truth(model)
    back = sender.rejoin()
    assert list(back) == [engines.urls[1]] and "restarted" in back[engines.urls[1]]
    _train_step(model, opt, seed=1)
    second = sync_weights(model, 2, sender)
    assert second is not None and second.engines_ok == engines.urls and second.attempts == 1
    assert second.engines_failed == {} and second.quarantined == {}
    for i in range(2):
        assert engines.label(i) == "2" and engines.checksum(i) == truth(model)

    # dead at a sync: quarantined, the other still updated; back once it answers
    engines.kill(1)
    _train_step(model, opt, seed=2)
    third = sync_weights(model, 3, sender)
    assert third is not None and third.engines_ok == [engines.urls[0]]
    assert list(sender.quarantined) == [engines.urls[1]]
    assert sender.rejoin() == {}  # still dead: nothing comes back
    engines.start(1)
    engines.wait(1)
    assert list(sender.rejoin()) == [engines.urls[1]] and sender.quarantined == {}
    fourth = sync_weights(model, 4, sender)
    assert fourth is not None and fourth.engines_ok == engines.urls
    assert [engines.label(i) for i in range(2)] == ["4", "4"]
    assert engines.checksum(1) == truth(model)

    # a learner that died without closing its group: the engines still hold it; a fresh sender (a new learner
    # process: here the old one's local end is simply dropped, as its death would) still joins both engines
    assert sender.group is not None
    sender.group.destroy()
    sender.http.close()
    fresh = WeightSender(engines.urls, CONFIG)
    assert fresh.connect() == {}
    _train_step(model, opt, seed=3)
    fifth = sync_weights(model, 5, fresh)
    assert fifth is not None and fifth.engines_ok == engines.urls
    assert engines.checksum(0) == engines.checksum(1) == truth(model)
    fresh.close()


def test_a_version_no_engine_got_is_not_announced(engines: Engines) -> None:
    model, opt = learner_model(engines.model_dir)
    pool = sorted(((u, 1) for u in engines.urls), reverse=True)  # not in the sender's (sorted) order
    publisher = WeightSyncPublisher(CONFIG, lambda: pool, is_main=True, wait_for_engines_s=5)
    assert publisher.sender is not None
    _train_step(model, opt, seed=0)
    assert publisher.publish(model, 1, initial=False).announce
    group = publisher.sender.group
    _train_step(model, opt, seed=1)
    assert publisher.publish(model, 2, initial=False).announce
    assert publisher.sender.group is group  # the same engines in another order: no rebuild at every sync
    engines.kill(0)
    engines.kill(1)
    _train_step(model, opt, seed=2)
    nowhere = publisher.publish(model, 3, initial=False)
    assert not nowhere.announce and nowhere.metrics["sync_engines_ok"] == 0
    assert not publisher.wants_resync()  # nobody to bring back yet
    engines.start(0)
    engines.wait(0)
    assert publisher.wants_resync()  # engine 0 answers again: sync now, not at the next step
    partial = publisher.publish(model, 3, initial=False)
    # engine 1 is still quarantined: out of the pool, so the version reached every engine there is
    assert partial.announce and partial.metrics["sync_engines_ok"] == 1
    assert partial.metrics["sync_engines_quarantined"] == 1 and partial.metrics["sync_engines_rejoined"] == 1
    assert engines.label(0) == "3" and engines.checksum(0) == truth(model)
    publisher.close()
