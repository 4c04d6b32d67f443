"""``streamrl up --up.launcher=ray``: the roles of ``up`` on a Ray cluster, supervised exactly as on one node.

Each role stays the process the local supervisor runs (the same ``python -m streamrl ROLE --config
RUN_DIR/config.toml ...`` and the same ``main()``); this module only places it. A :class:`RoleActor` per role
process, scheduled with the role's Ray resources, starts that command as its own child (which dies with the
actor: a lost node takes its roles with it) and writes its log into ``RUN_DIR/logs``. The supervisor
(streamrl.supervisor) sees each one through :class:`RemoteProcess`, a handle with the methods of a
``subprocess.Popen``, so restarts, budgets, the status line, summary.json and ``--resume`` are the local ones.

Placement (docs/cluster.md):

- engines: ``ray.engine_resources`` (default: the device plan's GPUs per engine, ``engine.tp_size`` for SGLang and 1
  for the built-in engine, on a cluster with GPUs, else one CPU; ``shared.placement = colocated`` is refused),
  placed before anything starts so their URLs (the node's address and a port free there) are in the config
  every role reads; a restarted engine goes back to its node.
- the learner: ``learner.world_size`` ranks in one placement group (``ray.learner_resources`` a bundle,
  ``ray.learner_strategy``), rank 0's node address as ``MASTER_ADDR`` and a port free there as ``MASTER_PORT``;
  each rank runs ``streamrl learner`` with ``RANK`` set (gloo on CPU, NCCL on GPU, as ever). A learner failure
  stops the run (``up --resume`` continues it): a lost node can leave its placement group unplaceable.
- Redis (unless ``shared.redis_url`` names a managed one) and the dashboard on the head node; Redis keeps its
  AOF in ``RUN_DIR/redis``.
- rollout workers, the evaluator and the archiver anywhere with their resources.

The run directory must be storage every node sees (the learner's checkpoints need it anyway; the learner checks
it at start). On a cluster whose nodes share one address (one host) the roles bind loopback as locally; across
hosts, engines and Redis bind their node's address.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.configlib import ConfigError
from common.lifecycle import die_with_parent
from rollout_fleet.fleet import engine_ranks
from streamrl.supervisor import ChildSpec

if TYPE_CHECKING:
    from streamrl.config import StreamRLConfig

log = logging.getLogger("streamrl.ray")

HEAD_RESOURCE = "node:__internal_head__"  # every Ray head node has it
LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOST = -int(signal.SIGKILL)
PLACEMENT_FILE = "placement.json"  # RUN_DIR/placement.json: node, address and pid of each role process  # the exit code of a process whose actor (or node) died


def engine_resources(config: StreamRLConfig, has_gpus: bool) -> dict[str, float]:
    """The Ray resources of one engine: ``ray.engine_resources``, else the device plan's GPUs per engine
    (SGLang's TP group, one for the built-in engine) on a cluster with GPUs, else one CPU."""
    if config.ray.engine_resources:
        return dict(config.ray.engine_resources)
    return {"GPU": float(engine_ranks(config.engine))} if has_gpus else {"CPU": 1.0}


def learner_resources(config: StreamRLConfig, has_gpus: bool) -> dict[str, float]:
    """The Ray bundle of one learner rank: ``ray.learner_resources``, else one GPU (one CPU without GPUs)."""
    if config.ray.learner_resources:
        return dict(config.ray.learner_resources)
    return {"GPU": 1.0} if has_gpus else {"CPU": 1.0}


def describe_cluster_plan(config: StreamRLConfig) -> list[str]:
    """What ``up --up.launcher=ray`` asks a cluster with GPUs for, as ``streamrl plan`` prints it (Ray picks the
    nodes and sets each actor's CUDA_VISIBLE_DEVICES)."""
    world, count = config.learner.world_size, config.engine.count
    return [
        "device plan (Ray cluster): Ray places each role by these resources and sets its CUDA_VISIBLE_DEVICES",
        f"  learner: {world} rank(s) x {learner_resources(config, True)} in one placement group "
        f"({config.ray.learner_strategy})",
        f"  engines: {count} x {engine_resources(config, True)}, each on one node",
        "  redis, dashboard: the head node; rollout workers, evaluator, archiver: anywhere, no GPU",
    ]


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "up.launcher = 'ray' needs Ray: pip install 'streamrl[ray]' (or run with --up.launcher=local)"
        ) from None
    return ray


class RunDirNotVisible(RuntimeError):
    """A role's node does not see the run directory (it must be storage every node shares)."""


class RoleActor:
    """Runs one role process on its node (made a Ray actor by :class:`RayLauncher`)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        from broker.server import free_port

        return free_port()

    def start(self, argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> int:
        config = argv[argv.index("--config") + 1] if "--config" in argv else None
        if config is not None and not Path(config).is_file():
            raise RunDirNotVisible(
                f"{socket.gethostname()} does not see {config}: the run directory must be on storage every "
                "node of the Ray cluster shares (docs/cluster.md)"
            )
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, *argv[1:]]  # this node's interpreter, wherever it lives
        with open(log_path, "ab") as fh:
            self.process = subprocess.Popen(
                argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                cwd=cwd if os.path.isdir(cwd) else None,
                start_new_session=True,
                # the role dies with its actor: a lost actor or node must not leave a role running unsupervised
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait_exit(self) -> int | None:
        """Block (on one of the actor's threads) until the role process exits; its exit code. The supervisor
        holds one such call per role and checks it locally, instead of asking every few tenths of a second: a
        Ray call costs CPU in the raylet and in the actor, which on a small machine the roles need."""
        return None if self.process is None else self.process.wait()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)


class ExitedProcess:
    """A role that could not be started (its resources or its node are gone): exited at once."""

    def __init__(self, code: int, note: str) -> None:
        self.pid, self.returncode, self.exit_note = 0, code, note

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def kill(self) -> None:
        pass


class RemoteProcess:
    """A role process inside a :class:`RoleActor`, with the methods of ``subprocess.Popen`` the supervisor uses.
    Exit codes are the process's; an actor that died (its node lost) reads as SIGKILL with ``exit_note``."""

    def __init__(self, ray: Any, actor: Any, pid: int, where: dict[str, Any], argv: list[str]) -> None:
        self.ray, self.actor, self.pid, self.where, self.argv = ray, actor, pid, where, argv
        self.returncode: int | None = None
        self.exit_note: str | None = None
        self._exit = actor.wait_exit.remote()  # resolves when the process exits, or fails with its actor

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _ = self.ray.wait([self._exit], timeout=0)  # a local check: no call to the actor
        if not ready:
            return None
        ref = self._exit
        try:
            code = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            code = LOST
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.exit_note = f"its Ray actor on {self.where['ip']} died, with its node?: {first[:200]}"
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.actor.signal.remote(int(sig))

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.argv, timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        try:
            self.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.ray.kill(self.actor)  # the role dies with its actor
            self.returncode, self.exit_note = LOST, "killed with its Ray actor"


# After one learner rank failed, how long the others get to notice before they are killed (learner.main).
FAILED_RANK_GRACE_S = 5.0


class RankGroup:
    """The learner's ranks as one child, as ``learner.main.spawn_ranks`` runs them locally: a rank that fails
    stops the others (SIGTERM, then SIGKILL after a short grace) and the learner exits 1; when all exit, the
    largest exit code."""

    def __init__(self, ranks: list[RemoteProcess]) -> None:
        self.ranks = ranks
        self.pid = ranks[0].pid
        self.returncode: int | None = None
        self.exit_note: str | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        codes = [r.poll() for r in self.ranks]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            rank = self.ranks[i]
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            note = f": {rank.exit_note}" if rank.exit_note else ""
            self.exit_note = f"learner rank {i} on {rank.where['ip']} died with {how}{note}"
            for r in self.ranks:
                r.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + FAILED_RANK_GRACE_S
            for r in self.ranks:
                try:
                    r.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    r.kill()
            self.returncode = CONFIG_ERROR if code == CONFIG_ERROR else 1
            return self.returncode
        if all(c is not None for c in codes):
            self.returncode = max(abs(c) for c in codes)  # type: ignore[arg-type]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for r in self.ranks:
            r.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.ranks[0].argv, timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        for r in self.ranks:
            r.kill()
        self.returncode = self.returncode if self.returncode is not None else LOST


CONFIG_ERROR = 2  # streamrl.supervisor.CONFIG_ERROR_EXIT: a rank that refuses its configuration stops the run


def _split(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options of a resource dict ({"CPU": 1, "GPU": 1, "custom": 1})."""
    rest = dict(resources)
    return {"num_cpus": rest.pop("CPU", 0), "num_gpus": rest.pop("GPU", 0), "resources": rest}


class RayLauncher:
    """Connects to (or starts) the Ray cluster, places the roles, and spawns them for the supervisor."""

    def __init__(self, config: StreamRLConfig) -> None:
        self.ray = ray = import_ray()
        self.config = config
        rc = config.ray
        common = {"namespace": rc.namespace, "log_to_driver": False, "ignore_reinit_error": True}
        if rc.address:
            ray.init(address=rc.address, **common)
        else:  # join the local cluster if one runs, else start one
            try:
                ray.init(address="auto", **common)
            except ConnectionError:
                ray.init(
                    num_cpus=rc.local_num_cpus,
                    object_store_memory=rc.local_object_store_mb * 1024**2,
                    include_dashboard=False,
                    **common,
                )
        # threads: wait_exit blocks one for the process's lifetime, signal and poll take the others
        self.remote_actor = ray.remote(max_concurrency=4, max_restarts=0)(RoleActor)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        heads = [n for n in nodes if HEAD_RESOURCE in n["Resources"]]
        self.head_ip = (heads or nodes)[0]["NodeManagerAddress"]
        self.multi_host = len({n["NodeManagerAddress"] for n in nodes}) > 1
        self.has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        self.actors: dict[str, Any] = {}  # the actor of each role process (learner ranks: learner-rank-R)
        self.engine_nodes: dict[str, str] = {}  # engine name -> node id it was placed on
        self.engine_ips: dict[str, str] = {}
        self.placement_groups: list[Any] = []
        self.placement: dict[str, dict[str, Any]] = {}  # where each role process runs: RUN_DIR/placement.json
        self.placement_path: Path | None = None
        self.cwd = os.getcwd()
        log.info("Ray cluster: %d node(s), head %s, GPUs: %s", len(nodes), self.head_ip, self.has_gpus)
        print(
            f"streamrl up: Ray launcher, {len(nodes)} node(s) (head {self.head_ip}), "
            f"{ray.cluster_resources().get('CPU', 0):.0f} CPUs, {ray.cluster_resources().get('GPU', 0):.0f} GPUs",
            flush=True,
        )

    # ---- resources of each role ------------------------------------------------------------------------------
    def engine_resources(self) -> dict[str, float]:
        return engine_resources(self.config, self.has_gpus)

    def learner_resources(self) -> dict[str, float]:
        return learner_resources(self.config, self.has_gpus)

    def role_options(self, role: str) -> dict[str, Any]:
        rc = self.config.ray
        if role in ("redis", "dashboard"):  # on the head node
            return {"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.001}}
        table = {"rollout": rc.rollout_resources, "eval": rc.eval_resources, "archive": rc.archive_resources}
        return _split(table.get(role, {"CPU": 1.0}))

    def _where(self, actor: Any, what: str, resources: Any) -> dict[str, Any]:
        try:
            return self.ray.get(actor.where.remote(), timeout=self.config.ray.placement_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(actor)
            raise ConfigError(
                f"{what}: no node of the Ray cluster had {resources} free within ray.placement_timeout_s = "
                f"{self.config.ray.placement_timeout_s:.0f} s (cluster: {self.ray.cluster_resources()}, free: "
                f"{self.ray.available_resources()})"
            ) from None

    # ---- before anything starts -----------------------------------------------------------------------------
    def place(self, cfg: StreamRLConfig) -> StreamRLConfig:
        """Place the engines (their URLs are part of the config every role reads) and choose the addresses Redis
        and the engines bind. Returns the config to write."""
        cfg = cfg.model_copy(deep=True)
        if cfg.rollout.router == "sglang" and cfg.rollout.sglang_router_port and self.multi_host:
            raise ConfigError(
                "rollout.router = 'sglang' on a multi-host Ray cluster: the router up would start binds "
                "engine.host on whatever node it lands; run one where every worker reaches it and set "
                "rollout.sglang_router_url (docs/rollout.md)"
            )
        self.placement_path = Path(cfg.shared.run_dir) / PLACEMENT_FILE
        resources = self.engine_resources()
        urls = []
        for i in range(cfg.engine.count):
            name = f"engine-{i}"
            actor = self.remote_actor.options(**_split(resources), name=None).remote()
            where = self._where(actor, name, resources)
            port = self.ray.get(actor.free_port.remote())
            host = where["ip"] if self.multi_host else cfg.engine.host
            self.actors[name], self.engine_nodes[name], self.engine_ips[name] = actor, where["node_id"], host
            urls.append(f"http://{host}:{port}")
            log.info("%s placed on %s (%s), port %d", name, where["hostname"], where["ip"], port)
        cfg.rollout.engine_urls = urls
        cfg.weight_sync.engine_urls = urls
        if not cfg.shared.redis_url and self.multi_host and cfg.redis.host in LOOPBACK:
            cfg.redis.host = (
                self.head_ip
            )  # its URL file (RUN_DIR/redis/url) then names an address all nodes reach
        try:  # engines on node addresses need the run secret (shared.auth "auto" becomes "on")
            cfg.resolve_auth()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cfg

    def adapt(
        self, before: list[list[ChildSpec]], after: list[list[ChildSpec]]
    ) -> tuple[list[list[ChildSpec]], list[list[ChildSpec]]]:
        """The local specs (stages of them), changed where the cluster differs: a learner failure stops the run."""
        for spec in (spec for stage in (*before, *after) for spec in stage):
            if spec.name == "learner":
                spec.restart = "never"
            elif spec.name in self.engine_ips and self.multi_host:
                spec.argv = [*spec.argv, f"--engine.host={self.engine_ips[spec.name]}"]
        return before, after

    # ---- the supervisor's spawner ---------------------------------------------------------------------------
    def spawn(self, spec: ChildSpec, log_path: Path) -> Any:
        if spec.name == "learner":
            return self._spawn_learner(spec, log_path)
        try:
            actor = self._actor_for(spec.name)
            where = self.ray.get(actor.where.remote(), timeout=self.config.ray.placement_timeout_s)
            pid = self.ray.get(
                actor.start.remote(spec.argv, spec.env, str(log_path), self.cwd),
                timeout=self.config.ray.placement_timeout_s,
            )
        except (self.ray.exceptions.RayError, ConfigError) as exc:
            return ExitedProcess(LOST, f"could not be started on the Ray cluster: {_first_line(exc)}")
        log.info("started %s on %s (pid %d), log %s", spec.name, where["ip"], pid, log_path)
        self._record(spec.name, where, pid)
        return RemoteProcess(self.ray, actor, pid, where, spec.argv)

    def _record(self, name: str, where: dict[str, Any], pid: int) -> None:
        self.placement[name] = {**where, "pid": pid, "started": time.time()}
        if self.placement_path is not None:
            tmp = self.placement_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.placement, indent=2) + "\n")
            os.replace(tmp, self.placement_path)

    def _actor_for(self, name: str) -> Any:
        """The role's actor: an engine keeps its actor (its node and resources) while it lives and goes back to its
        node when it died; any other role gets a fresh actor, placed anew."""
        old = self.actors.get(name)
        if name in self.engine_nodes:
            if old is not None and self._alive(old):
                return old
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            strategy = NodeAffinitySchedulingStrategy(self.engine_nodes[name], soft=False)
            actor = self.remote_actor.options(
                **_split(self.engine_resources()), scheduling_strategy=strategy
            ).remote()
        else:
            if old is not None:
                self.ray.kill(old)
            role = name.split("-")[0]
            actor = self.remote_actor.options(**self.role_options(role)).remote()
        self.actors[name] = actor
        return actor

    def _alive(self, actor: Any) -> bool:
        try:
            self.ray.get(actor.poll.remote(), timeout=10)
            return True
        except self.ray.exceptions.RayError:
            return False

    def _spawn_learner(self, spec: ChildSpec, log_path: Path) -> Any:
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world = self.config.learner.world_size
        bundle = self.learner_resources()
        for pg in self.placement_groups:  # a learner started again: the old ranks are gone
            remove_placement_group(pg)
        self.placement_groups = []
        pg = placement_group([dict(bundle) for _ in range(world)], strategy=self.config.ray.learner_strategy)
        self.placement_groups.append(pg)
        try:
            self.ray.get(pg.ready(), timeout=self.config.ray.placement_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            return ExitedProcess(
                CONFIG_ERROR,
                f"its placement group of {world} x {bundle} ({self.config.ray.learner_strategy}) could not be "
                f"placed within ray.placement_timeout_s = {self.config.ray.placement_timeout_s:.0f} s "
                f"(cluster: {self.ray.cluster_resources()}, free: {self.ray.available_resources()})",
            )
        actors = []
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            actors.append(self.remote_actor.options(**_split(bundle), scheduling_strategy=strategy).remote())
            self.actors[f"learner-rank-{rank}"] = actors[-1]
        try:
            wheres = self.ray.get(
                [a.where.remote() for a in actors], timeout=self.config.ray.placement_timeout_s
            )
            master_port = self.ray.get(actors[0].free_port.remote())
            argv = list(spec.argv)
            if self.multi_host and self.config.weight_sync.master_address is None:
                # engines reach rank 0 for the weight-update group at the address Ray knows its node by
                argv.append(f"--weight_sync.master_address={wheres[0]['ip']}")
            ranks = []
            for rank, (actor, where) in enumerate(zip(actors, wheres, strict=True)):
                env = {
                    **spec.env,
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    # a rank with GPUs sees only its own (Ray sets CUDA_VISIBLE_DEVICES): its device 0
                    "LOCAL_RANK": "0" if where["gpus"] else str(rank),
                    "MASTER_ADDR": wheres[0]["ip"],
                    "MASTER_PORT": str(master_port),
                }
                path = log_path if rank == 0 else log_path.with_name(f"{spec.name}-rank{rank}.log")
                pid = self.ray.get(actor.start.remote(argv, env, str(path), self.cwd), timeout=60)
                log.info("started learner rank %d on %s (pid %d), log %s", rank, where["ip"], pid, path)
                self._record(f"learner-rank-{rank}", where, pid)
                ranks.append(RemoteProcess(self.ray, actor, pid, where, argv))
        except self.ray.exceptions.RayError as exc:
            return ExitedProcess(
                LOST, f"its ranks could not be started on the Ray cluster: {_first_line(exc)}"
            )
        nodes = sorted({w["ip"] + "/" + w["node_id"][:8] for w in wheres})
        print(f"streamrl up: learner ranks on {len(nodes)} node(s): {', '.join(nodes)}", flush=True)
        return RankGroup(ranks)

    def shutdown(self) -> None:
        """Kill every actor (their role processes have been stopped by the supervisor) and leave the cluster."""
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors.values():
            try:
                self.ray.kill(actor)
            except Exception as exc:  # already gone
                log.debug("ray.kill: %s", exc)
        for pg in self.placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as exc:
                log.debug("remove_placement_group: %s", exc)
        self.actors, self.placement_groups = {}, []
        self.ray.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
