"""The `job` section: roles placed on Monarch job host meshes (ProcessJob here; SLURM and
Kubernetes as documented configs whose keys are checked)."""

import asyncio
import os
import re

import psutil
import pytest
import torch
from roles import running
from safetensors.torch import load_file
from test_grpo import CONFIG, MODEL, rows, small

from apps.grpo import Config
from forge import checkpoint
from forge.config import ConfigError, load_config
from forge.shm import ROOT

PROCESS_JOB = {
    "job.kind": "process",
    "job.meshes": "{trainer: 1, generator: 1}",
    "job.placement": "{trainer: trainer, store: trainer, generator: generator}",
}


@pytest.mark.parametrize(
    "config", ["configs/grpo_qwen3_1.7b_gsm8k_slurm.yaml", "configs/grpo_qwen3_1.7b_gsm8k_k8s.yaml"]
)
def test_cluster_configs_are_valid(tmp_path, tiny_model_dir, config):
    """The documented cluster configs load (their `base`, the GSM8K GPU config, beneath them)
    with only the model and data paths replaced; their job arguments fit Monarch's job classes."""
    from test_data import gsm8k_like

    data = gsm8k_like(tmp_path / "train.jsonl")
    cfg = load_config(config, [f"model.path={tiny_model_dir}", f"dataset.path={data}"], Config)
    assert cfg.task == "gsm8k" and cfg.rewards.weights == {"math": 1.0}  # from the base
    assert cfg.job.placement["generator"] == "generator" and cfg.generator_replicas == 16
    assert cfg.trainer.serve_weights_on == "0.0.0.0" and cfg.batch_size == 128


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"job.kind": "pbs"}, "config key 'job.kind': 'pbs' is not one of local, process, slurm, kubernetes"),
        ({"job.meshes": "{a: 1}"}, "config key 'job.meshes': a local job runs every role on this host"),
        ({**PROCESS_JOB, "job.meshes": "{trainer: 0}"}, "config key 'job.meshes': name each host mesh"),
        ({**PROCESS_JOB, "job.placement": "{trainr: trainer}"}, "config key 'job.placement.trainr': not a role"),
        ({**PROCESS_JOB, "job.placement": "{trainer: gpus}"}, "config key 'job.placement.trainer': no mesh 'gpus'"),
        (
            {"job.kind": "slurm", "job.meshes": "{trainer: 2, generator: 8}", "job.args": "{partition: gpu}"},
            "config key 'job.placement': no role is placed on job.meshes trainer, generator",
        ),
        (
            {**PROCESS_JOB, "job.meshes": "{trainer: 1, generator: 1, spare: 2}"},
            "config key 'job.placement': no role is placed on job.meshes spare",
        ),
        (
            {"job.kind": "slurm", "job.meshes": "{t: 1}", "job.args": "{partion: gpu}"},
            "config key 'job.args': SlurmJob: got an unexpected keyword argument 'partion'",
        ),
        (
            {"job.kind": "kubernetes", "job.meshes": "{t: 1}"},
            "config key 'job.args': KubernetesJob: missing a required argument: 'namespace'",
        ),
        (
            {
                "job.kind": "kubernetes",
                "job.meshes": "{t: 1}",
                "job.args": "{namespace: n}",
                "job.mesh_args": "{prt: 1}",
            },
            "config key 'job.mesh_args': KubernetesJob.add_mesh: got an unexpected keyword argument 'prt'",
        ),
        (  # the agent pool on the cluster's hosts, the gateway on the controller's loopback
            {
                "job.kind": "slurm",
                "job.meshes": "{pool: 2}",
                "job.args": "{partition: cpu}",
                "job.placement": "{envs: pool}",
                "agentic.agent": "services.envs.calculator:calculator_agent",
                "rollout": "forge.rollout:generate_and_score",
            },
            "config keys 'job.placement.envs' and 'agentic.gateway.host': the agent pool runs on other hosts",
        ),
        (  # a pod mesh's name is a DNS label: KubernetesJob would refuse it once the run starts
            {
                "job.kind": "kubernetes",
                "job.meshes": "{gen_pool: 1}",
                "job.args": "{namespace: n}",
                "job.placement": "{generator: gen_pool}",
            },
            "config key 'job.meshes.gen_pool': a kubernetes mesh's name is lowercase letters and digits",
        ),
    ],
)
def test_bad_job_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [f"{k}={v}" for k, v in overrides.items()], Config)
    assert message in str(e.value)


def test_a_trainer_on_several_hosts_splits_the_batch_over_the_ranks_of_every_host():
    """`trainer_procs` run on each host of the trainer's mesh: the trainer has procs x hosts
    ranks, so each step's rows (padded by collate) and the config's batch check count them all."""
    from apps.grpo import batch_rows

    two_hosts = {**PROCESS_JOB, "job.meshes": "{trainer: 2, generator: 1}", "trainer_procs": 2}
    cfg = load_config(CONFIG, [f"{k}={v}" for k, v in {**two_hosts, "trainer.grad_accum": 4}.items()], Config)
    assert batch_rows(cfg) == 2 * 2 * 4
    # 64 episodes over 2 procs x 32 micro-batches, but 4 ranks x 32 on two hosts: the first step would fail
    with pytest.raises(ConfigError, match=r"trainer_procs x trainer.grad_accum x 2 trainer hosts \(job.meshes\) = 128"):
        load_config(CONFIG, [f"{k}={v}" for k, v in {**two_hosts, "trainer.grad_accum": 32}.items()], Config)


@pytest.mark.parametrize("procs, hosts, ep", [(2, 1, 4), (8, 1, 3), (2, 2, 8)])
def test_expert_parallel_that_does_not_divide_the_trainer_s_ranks_is_refused(procs, hosts, ep):
    """EP splits the experts over a divisor of the trainer's ranks (procs x hosts of its mesh):
    refused when the config loads, not when the trainer builds its device mesh on the cluster."""
    job = {**PROCESS_JOB, "job.meshes": f"{{trainer: {hosts}, generator: 1}}"}
    over = {**job, "trainer_procs": procs, "trainer.expert_parallel": ep, "trainer.grad_accum": 1}
    with pytest.raises(ConfigError, match=rf"'trainer.expert_parallel': {ep} does not divide .* {procs * hosts} ranks"):
        load_config(CONFIG, [f"{k}={v}" for k, v in over.items()], Config)
    ok = {**over, "trainer.expert_parallel": procs * hosts}
    assert load_config(CONFIG, [f"{k}={v}" for k, v in ok.items()], Config).trainer.expert_parallel == procs * hosts


def test_generator_replicas_sharing_a_job_host_get_gpus_of_their_own():
    """Replica i runs on host i % hosts of the generator's mesh; the replicas of one host each
    take GPUs of their own (tensor_parallel_size of them), not all the host's first. On this
    host (no job mesh) they share them, as the one-GPU configs do."""
    from services.roles import generator_options

    class Hosts:  # a host mesh's shape and its slices, as Monarch's HostMesh gives them
        sizes = {"hosts": 2}

        def slice(self, hosts: int) -> str:
            return f"host {hosts}"

    cfg = load_config(CONFIG, ["generator_replicas=4", "generator.engine={tensor_parallel_size: 2}"], Config)
    placed = [generator_options(cfg, Hosts()).for_replica(i) for i in range(4)]
    assert [(p.hosts, p.env["CUDA_VISIBLE_DEVICES"]) for p in placed] == [
        ("host 0", "0,1"),
        ("host 1", "0,1"),
        ("host 0", "2,3"),
        ("host 1", "2,3"),
    ]
    assert generator_options(cfg, None).for_replica(3).env == {}


@pytest.mark.parametrize(
    "override, message",
    [
        ("generator_replicas=32", "config key 'generator_replicas': 16 replicas x 1 GPUs on each of 2 generator hosts"),
        ("generator.engine.tensor_parallel_size=2", "8 replicas x 2 GPUs on each of 2 generator hosts"),
        ("trainer_procs=16", "config key 'trainer_procs': 16 procs on each trainer host"),
    ],
)
def test_procs_that_do_not_fit_a_slurm_node_s_gpus_are_refused(tmp_path, tiny_model_dir, override, message):
    """`job.args.gpus_per_node` is what each node has: a role's procs on a node that asks for
    more (a GPU each, a generator replica its tensor-parallel GPUs) are refused when the config
    loads, not when their engines fail to find a GPU on the allocated nodes."""
    from test_data import gsm8k_like

    paths = [f"model.path={tiny_model_dir}", f"dataset.path={gsm8k_like(tmp_path / 'train.jsonl')}"]
    slurm = "configs/grpo_qwen3_1.7b_gsm8k_slurm.yaml"
    with pytest.raises(ConfigError, match=re.escape(message) + r".*job.args.gpus_per_node is 8"):
        load_config(slurm, [*paths, "trainer.grad_accum=1", override], Config)


def test_a_base_cycle_is_named(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\napp: grpo\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="config key 'base' makes a cycle"):
        load_config(tmp_path / "a.yaml", [], Config)
    (tmp_path / "c.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(tmp_path / "c.yaml", [], Config)


def host_of(title: str) -> str:
    """The ProcessJob host (its worker's HYPERACTOR_PROCESS_NAME) of this test's process titled `title`."""
    [proc] = [p for p in psutil.Process().children(recursive=True) if p.cmdline()[:1] == [title]]
    for parent in proc.parents():
        if parent.pid == os.getpid():
            break
        name = parent.environ().get("HYPERACTOR_PROCESS_NAME")
        if name is not None:
            return name
    return "this host"


@pytest.mark.slow  # 50 s: a GRPO run over two job hosts
def test_grpo_with_the_trainer_and_the_generator_on_two_process_job_hosts(tmp_path):
    """A short GRPO run with the trainer (and the weight store) on one ProcessJob host and the
    generator on another, weights streamed across them (forge.transfer): parameters change,
    versions advance, and the job's processes and their /dev/shm directories end with the run."""
    from apps.grpo import train
    from apps.sft import warm_start
    from services.roles import Roles

    cfg = load_config(CONFIG, small(tmp_path, steps=2, checkpoint_every=2, **PROCESS_JOB), Config)
    placed: dict[str, str] = {}
    spawned: list[psutil.Process] = []
    generator_versions: list[int] = []

    async def main():
        services = await Roles.start(cfg, warm_start)  # the model, if no earlier test built it
        try:
            spawned.extend(psutil.Process().children(recursive=True))
            placed.update({role: host_of(f"forge:{role}") for role in ("trainer", "generator", "store", "rewards")})
            await train(cfg, services)
            # The generator's host is not the writer's: a version reaches it only as a host copy.
            for _ in range(300):
                generator_versions.append(await services.gen.policy_version.route())
                if generator_versions[-1] == 2:
                    break
                await asyncio.sleep(0.1)
        finally:
            await services.shutdown()

    asyncio.run(main())
    assert placed == {"trainer": "trainer_0", "generator": "generator_0", "store": "trainer_0", "rewards": "this host"}
    assert [r["step"] for r in rows(cfg.run_dir)] == [1, 2]
    assert generator_versions[-1] == 2, generator_versions
    saved = checkpoint.load_run_state(checkpoint.latest(cfg.run_dir))
    assert saved["version"] == 2
    trained, initial = load_file(cfg.run_dir / "model/model.safetensors"), load_file(MODEL / "model.safetensors")
    # (a batch whose groups all scored alike would train nothing: the rows say so if it fails)
    learned = [(r.get("reward_std"), r.get("grad_norm")) for r in rows(cfg.run_dir)]
    assert any(not torch.equal(trained[k], initial[k]) for k in initial), learned
    _, alive = psutil.wait_procs([p for p in spawned if p.pid != os.getpid()], timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    assert not [d for d in ROOT.glob("run-*") if d.name.split("-")[1] in {str(p.pid) for p in spawned}]


def test_roles_that_started_stop_when_a_later_role_fails_to(monkeypatch):
    """With the local job (whose stop() stops nothing) a role that fails to start, here the
    rewards, takes down the roles started before it: the store, trainer and generator."""
    from types import SimpleNamespace as NS

    from service_actors import Stand, Unready

    import services.roles as roles
    from forge.schema import JobConfig

    class Sync:  # the trainer and generator stand-ins have no weights to follow
        def __init__(self, *args):
            self.stopped = False

        async def start(self):
            pass

        async def stop(self):
            self.stopped = True

    syncs = []
    monkeypatch.setattr(roles, "resolve_model", lambda *args: "model")
    monkeypatch.setattr(roles, "weight_store", lambda *args: None)
    monkeypatch.setattr(roles, "WeightSync", lambda *args: syncs.append(Sync()) or syncs[-1])
    monkeypatch.setattr(roles, "Trainer", Stand)
    monkeypatch.setattr(roles, "Generator", Stand)
    monkeypatch.setattr(roles, "Rewards", Unready)
    cfg = NS(
        model=None,
        distill=NS(teachers=[]),
        algorithm="grpo",
        ppo=NS(critic_path=None),
        job=JobConfig(),
        trainer_procs=1,
        trainer_restores=1,
        trainer=NS(lora=NS(enabled=False), loss=NS(kl_coef=0.0)),
        generator_replicas=1,
        generator_gpus=lambda: 1,
        generator=None,
        rewards=NS(replicas=1),
    )
    with pytest.raises(RuntimeError, match="cannot start: no verifier"):
        asyncio.run(roles.Roles.start(cfg))
    _, alive = psutil.wait_procs(running(psutil.Process(), ("store", "stand", "unready")), timeout=10)
    assert not alive, [p.cmdline() for p in alive]
    assert syncs[0].stopped
