"""Placement rules, table-driven: model matching, counts, fractions, alternatives, CPUs and
memory, the reasons given, and what can never fit (corral.infra.placement, pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from corral.capacity import Capacity, Grant, fit_problem, replica_env
from corral.infra._ray_resources import ray_options
from corral.infra.inventory import Gpu, Inventory, InventoryError, load_inventory, read_nvml
from corral.infra.placement import (
    AskError,
    Claim,
    Holder,
    NoFit,
    ask_of,
    misfits,
    model_matches,
    place,
    share_warnings,
)
from corral.spec import parse_spec
from corral.state import Store

GiB = 1024**3

MACHINE = Inventory(
    gpus=(
        Gpu(0, "NVIDIA A100-SXM4-80GB", "GPU-a0", 80 * GiB),
        Gpu(1, "NVIDIA A100-SXM4-80GB", "GPU-a1", 80 * GiB),
        Gpu(2, "NVIDIA L4", "GPU-l2", 24 * GiB),
        Gpu(3, "NVIDIA L4", "GPU-l3", 24 * GiB),
    ),
    cpus=8,
    memory=64 * GiB,
    cpu_ids=tuple(range(8)),
    source="test",
)


@pytest.mark.parametrize(
    ("model", "name", "memory", "expected"),
    [
        ("H100", "NVIDIA H100 80GB HBM3", 80, True),
        ("h100", "NVIDIA H100 80GB HBM3", 80, True),
        ("H200", "NVIDIA H100 80GB HBM3", 80, False),
        ("A100", "NVIDIA A100-SXM4-40GB", 40, True),
        ("A100", "NVIDIA A100-SXM4-80GB", 80, True),
        ("A100-80GB", "NVIDIA A100-SXM4-80GB", 80, True),
        ("A100-80GB", "NVIDIA A100 80GB PCIe", 80, True),
        ("A100-80GB", "NVIDIA A100-SXM4-40GB", 40, False),
        ("A100-80G", "NVIDIA A100-SXM4-80GB", 80, True),  # Ray's spelling
        ("A10", "NVIDIA A10G", 24, False),
        ("A10", "NVIDIA A100-SXM4-40GB", 40, False),
        ("A10", "NVIDIA A10", 24, True),
        ("A10G", "NVIDIA A10G", 24, True),
        ("L4", "NVIDIA L4", 24, True),
        ("L4", "NVIDIA L40S", 48, False),
        ("L40S", "NVIDIA L40S", 48, True),
        ("T4", "Tesla T4", 16, True),
        ("V100-32GB", "Tesla V100-SXM2-32GB", 32, True),
        ("V100-32GB", "Tesla V100-SXM2-16GB", 16, False),
        ("RTX4090", "NVIDIA GeForce RTX 4090", 24, True),
        ("NVIDIA-A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB", 80, True),  # a Kubernetes label
        ("H100-80GB", "NVIDIA H100", 80, True),  # size from the device's memory
        ("H100-80GB", "NVIDIA H100", 94, False),
        ("GPU", "Tesla T4", 16, True),
    ],
)
def test_model_matching(model: str, name: str, memory: int, expected: bool) -> None:
    assert model_matches(model, Gpu(0, name, None, memory * GiB)) is expected


def holder(service: str, rid: int, *addresses: str, share: float = 1.0, **kw: Any) -> Holder:
    return Holder(service, rid, Claim(gpus={a: share for a in addresses}, **kw))


@pytest.mark.parametrize(
    ("accelerators", "holders", "gpus"),
    [
        (["A100:1"], [], {"GPU-a0": 1.0}),
        (["A100:2"], [], {"GPU-a0": 1.0, "GPU-a1": 1.0}),
        (["A100:1"], [holder("a", 1, "GPU-a0")], {"GPU-a1": 1.0}),
        (["L4:2"], [holder("a", 1, "GPU-a0")], {"GPU-l2": 1.0, "GPU-l3": 1.0}),
        # a set / list: the first option that fits now, in the order written
        (["A100:1", "L4:1"], [holder("a", 1, "GPU-a0", "GPU-a1")], {"GPU-l2": 1.0}),
        (["L4:1", "A100:1"], [], {"GPU-l2": 1.0}),
        (["A100:1", "L4:2"], [holder("a", 1, "GPU-a0", "GPU-a1")], {"GPU-l2": 1.0, "GPU-l3": 1.0}),
        # any model: by memory, then index (the smaller card first)
        (["GPU:1"], [], {"GPU-l2": 1.0}),
        (["GPU:4"], [], {"GPU-a0": 1.0, "GPU-a1": 1.0, "GPU-l2": 1.0, "GPU-l3": 1.0}),
        # fractions share a device, the fullest one that still has room first
        (["L4:0.5"], [], {"GPU-l2": 0.5}),
        (["L4:0.5"], [holder("a", 1, "GPU-l3", share=0.5)], {"GPU-l3": 0.5}),
        (["L4:0.5"], [holder("a", 1, "GPU-l2", share=0.75)], {"GPU-l3": 0.5}),
    ],
)
def test_place_takes(accelerators: list[str], holders: list[Holder], gpus: dict) -> None:
    claim = place(ask_of({"accelerators": accelerators}), MACHINE, holders)
    assert isinstance(claim, Claim), claim
    assert dict(claim.gpus) == gpus


def test_plain_model_takes_the_smaller_card_first() -> None:
    machine = Inventory(
        gpus=(
            Gpu(0, "NVIDIA A100-SXM4-80GB", None, 80 * GiB),
            Gpu(1, "NVIDIA A100-SXM4-40GB", None, 40 * GiB),
        ),
        cpus=1,
        memory=GiB,
    )
    first = place(ask_of({"accelerators": ["A100:1"]}), machine, [])
    assert isinstance(first, Claim) and dict(first.gpus) == {"1": 1.0}
    # the 80 GB ask still finds its card
    big = place(ask_of({"accelerators": ["A100-80GB:1"]}), machine, [holder("a", 1, "1")])
    assert isinstance(big, Claim) and dict(big.gpus) == {"0": 1.0}


@pytest.mark.parametrize(
    ("resources", "holders", "reason"),
    [
        (
            {"accelerators": ["A100:1"]},
            [holder("svc-a", 1, "GPU-a0"), holder("svc-a", 2, "GPU-a1")],
            "needs 1x A100; the machine has 2 A100, both held by svc-a replicas 1 and 2",
        ),
        (
            {"accelerators": ["A100:2"]},
            [holder("svc-a", 1, "GPU-a0")],
            "needs 2x A100; the machine has 2 A100, 1 free, 1 held by svc-a replica 1",
        ),
        (
            {"accelerators": ["L4:1", "A100:1"]},
            [holder("b", 3, "GPU-l2", "GPU-l3"), holder("c", 4, "GPU-a0", "GPU-a1")],
            "needs 1x L4 or 1x A100; the machine has 2 L4, both held by b replica 3; "
            "the machine has 2 A100, both held by c replica 4",
        ),
        (
            {"accelerators": ["L4:0.5"]},
            [holder("b", 3, "GPU-l2", share=0.75), holder("b", 4, "GPU-l3")],
            "needs 0.5 of one L4; the machine has 2 L4, both held by b replicas 3 and 4",
        ),
        (
            {"cpus": "4", "cpu_pinning": "exclusive"},
            [holder("a", 1, cpus=6.0, exclusive=True), holder("b", 2, cpus=8.0)],
            "needs 4 CPUs of its own; the machine has 8, 2 not reserved (held: 6 by a replica 1)",
        ),
    ],
)
def test_place_waits_with_reason(
    resources: dict[str, Any], holders: list[Holder], reason: str
) -> None:
    outcome = place(ask_of(resources), MACHINE, holders)
    assert isinstance(outcome, NoFit)
    assert outcome.reason == reason


def test_exclusive_cpus_are_pinned_to_ids_nobody_else_holds() -> None:
    held = [holder("a", 1, cpus=2.0, cpu_ids=(0, 1), exclusive=True), holder("b", 2, cpus=8.0)]
    exclusive = {"cpus": 3, "cpu_pinning": "exclusive"}
    claim = place(ask_of(exclusive), MACHINE, held)
    assert isinstance(claim, Claim) and claim.cpu_ids == (2, 3, 4) and claim.exclusive
    declared = Inventory(MACHINE.gpus, 8, GiB)  # a declared count names no real CPU
    unpinned = place(ask_of(exclusive), declared, [])
    assert isinstance(unpinned, Claim) and unpinned.cpu_ids == () and unpinned.exclusive
    # a claim stored before the flag existed was exclusive exactly when it was pinned
    assert Claim.from_json({"cpus": 2, "cpu_ids": [0, 1]}).exclusive
    assert not Claim.from_json({"cpus": 2}).exclusive


TWO_CORES = Inventory((), 2, 8 * GiB, cpu_ids=(0, 1), source="test")


@pytest.mark.parametrize("cpus", [2, "2+", 0.75, "16"])
def test_shared_cpus_never_wait_nor_pin(cpus: Any) -> None:
    """SkyPilot's `cpus: 2+` sizes a VM; on one machine replicas share its cores: four of them
    on two cores all run, none pinned (issue: the second one stayed PENDING for good)."""
    ask = ask_of({"cpus": cpus, "memory": "4+"})
    assert misfits(ask, TWO_CORES) == []
    holders: list[Holder] = []
    for n in range(4):
        claim = place(ask, TWO_CORES, holders)
        assert isinstance(claim, Claim), claim
        assert claim.cpu_ids == () and not claim.exclusive and claim.memory == 4 * GiB
        holders.append(Holder("svc", n, claim))
    warned = share_warnings(ask, 4, TWO_CORES)
    assert any(w.startswith("resources.cpus: 4 replicas x ") for w in warned), warned
    assert any("they share them" in w and "cpu_pinning: exclusive" in w for w in warned)
    assert any(w.startswith("resources.memory: 4 replicas x 4 GiB") for w in warned), warned
    assert share_warnings(ask_of({"cpus": 1}), 2, TWO_CORES) == []


def test_memory_of_a_large_machine_is_said_without_an_exponent() -> None:
    """A GPU server's memory in TiB was written as "2.05e+03 GiB" in refusals and warnings."""
    server = Inventory((), 64, 2048 * GiB, source="test")
    (problem,) = misfits(ask_of({"memory": "4096"}), server)
    assert "needs 4096 GiB; the machine has 2048 GiB" in str(problem), str(problem)
    (warning,) = share_warnings(ask_of({"memory": "1000+"}), 4, server)
    assert "4 replicas x 1000 GiB asked, the machine has 2048 GiB" in warning, warning
    assert "e+" not in str(problem) + warning


def test_exclusive_cpus_wait_and_warn() -> None:
    ask = ask_of({"cpus": 2, "cpu_pinning": "exclusive"})
    first = place(ask, TWO_CORES, [])
    assert isinstance(first, Claim) and first.cpu_ids == (0, 1)
    second = place(ask, TWO_CORES, [Holder("svc", 1, first)])
    assert isinstance(second, NoFit) and "needs 2 CPUs of its own" in second.reason
    (warning,) = share_warnings(ask, 2, TWO_CORES)
    assert "1 run at once, the others wait" in warning
    (too_many,) = misfits(ask_of({"cpus": 3, "cpu_pinning": "exclusive"}), TWO_CORES)
    assert too_many.field == "resources.cpus"


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"cpu_pinning": "exclusive"}, "resources.cpu_pinning"),
        ({"cpus": "0.5", "cpu_pinning": "exclusive"}, "resources.cpus"),
    ],
)
def test_exclusive_needs_whole_cpus(resources: dict[str, Any], field: str) -> None:
    with pytest.raises(AskError) as caught:
        ask_of(resources)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("resources", "field", "text"),
    [
        ({"accelerators": ["H100:1"]}, "resources.accelerators", "the machine has no H100"),
        ({"accelerators": ["A100:3"]}, "resources.accelerators", "the machine has 2 A100"),
        ({"accelerators": ["GPU:5"]}, "resources.accelerators", "the machine has 4 GPU"),
        ({"accelerators": ["A100-40GB:1"]}, "resources.accelerators", "no A100-40GB"),
        ({"cpus": "16", "cpu_pinning": "exclusive"}, "resources.cpus", "needs 16 CPUs"),
        ({"memory": "128"}, "resources.memory", "needs 128 GiB"),
    ],
)
def test_a_misfit_names_field_and_lists_inventory(
    resources: dict[str, Any], field: str, text: str
) -> None:
    (problem,) = misfits(ask_of(resources), MACHINE)
    assert problem.field == field
    message = str(problem)
    assert message.startswith(f"{field}: ") and text in message
    assert message.endswith("(inventory from test)")
    # what the machine has of that resource, not the whole inventory (it was ~330 characters)
    assert len(message) < 160 and "0: NVIDIA" not in message, message
    if field == "resources.accelerators":
        assert "its GPUs: 2x NVIDIA A100-SXM4-80GB 80 GiB, 2x NVIDIA L4 24 GiB" in message


def test_an_alternative_that_exists_fits() -> None:
    assert misfits(ask_of({"accelerators": ["H100:1", "L4:1"]}), MACHINE) == []
    assert misfits(ask_of({"accelerators": ["A100:2"], "cpus": 8}), MACHINE) == []


@pytest.mark.parametrize("bad", ["A100:1.5", "A100:2.25"])
def test_malformed_counts_are_refused(bad: str) -> None:
    with pytest.raises(AskError) as caught:
        ask_of({"accelerators": [bad]})
    assert caught.value.field == "resources.accelerators"
    problem = fit_problem({"accelerators": [bad]}, MACHINE)
    assert problem is not None and "whole number" in problem and "NVIDIA" not in problem


def test_replica_env_names_devices_by_uuid_else_by_index() -> None:
    claim = Claim(gpus={"GPU-l3": 1.0, "GPU-a0": 1.0})
    env = replica_env(claim, MACHINE)
    assert env == {
        "CUDA_VISIBLE_DEVICES": "GPU-a0,GPU-l3",
        "NVIDIA_VISIBLE_DEVICES": "GPU-a0,GPU-l3",
    }
    by_index = Inventory((Gpu(0, "NVIDIA L4"), Gpu(1, "NVIDIA L4")), 1, GiB)
    env = replica_env(Claim(gpus={"1": 1.0}), by_index)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # no ask on a machine with GPUs: none visible; no GPUs at all: nothing set
    assert replica_env(Claim(), MACHINE) == {
        "CUDA_VISIBLE_DEVICES": "",
        "NVIDIA_VISIBLE_DEVICES": "void",
    }
    assert replica_env(Claim(), Inventory((), 1, GiB)) == {}


def test_cpu_pinning_on_ray_is_a_note_not_a_wrong_reason() -> None:
    placement = ray_options({"cpus": "2", "cpu_pinning": "exclusive"})
    assert placement.options["num_cpus"] == 2
    assert placement.notes == ["cpu_pinning 'exclusive': Ray reserves num_cpus but pins no CPU"]
    assert ray_options({"cpus": "2", "cpu_pinning": "shared"}).notes == []


def test_gpus_none_hides_every_gpu(tmp_path: Path) -> None:
    """`--gpus none` (CORRAL_GPUS=none) on a GPU machine leaves corral no GPU, and its replicas
    must see none (it was: no variable at all, so every replica saw every GPU)."""
    path = _write(tmp_path, "gpus: [NVIDIA L4, NVIDIA L4]\n")
    hidden = {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}
    for selection in ("none", "NONE", " none "):
        inv = load_inventory({"CORRAL_INVENTORY": str(path), "CORRAL_GPUS": selection})
        assert inv.gpus == () and replica_env(Claim(cpus=1.0), inv) == hidden
    unselected = load_inventory({"CORRAL_INVENTORY": str(_write(tmp_path, "gpus: []\n"))})
    assert replica_env(Claim(), unselected) == {}  # no GPU seen, none set aside


def test_nvml_absent_means_no_gpus() -> None:
    gpus, why = read_nvml()  # this machine has no GPU driver
    if gpus:
        pytest.skip("NVML sees GPUs here")
    assert "NVML" in why


def test_declared_inventory(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        "gpus:\n"
        "  - {name: NVIDIA A100-SXM4-80GB, uuid: GPU-a0, memory: 80GB}\n"
        "  - NVIDIA L4\n"
        "memory: 16\n"
    )
    inv = load_inventory({"CORRAL_INVENTORY": str(path)})
    assert [(g.index, g.name, g.address) for g in inv.gpus] == [
        (0, "NVIDIA A100-SXM4-80GB", "GPU-a0"),
        (1, "NVIDIA L4", "1"),
    ]
    assert inv.memory == 16 * GiB and inv.cpu_ids  # CPUs not declared: the real ones
    picked = load_inventory({"CORRAL_INVENTORY": str(path), "CORRAL_GPUS": "1"})
    assert [g.index for g in picked.gpus] == [1]
    assert load_inventory({"CORRAL_INVENTORY": str(path), "CORRAL_GPUS": "none"}).gpus == ()
    counted = load_inventory({"CORRAL_INVENTORY": str(_write(tmp_path, "cpus: 32\n"))})
    assert counted.cpus == 32 and counted.cpu_ids == ()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "other.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("gpus: 4\n", {}, "gpus: expected a list"),
        ("gpus:\n  - {model: L4}\n", {}, "gpus[0]: expected a device with a name"),
        ("gpus:\n  - {name: L4, index: -1}\n", {}, "gpus[0].index"),
        ("gpus:\n  - {name: L4, colour: red}\n", {}, "unknown field(s) colour"),
        ("gpus:\n  - {name: L4, uuid: X}\n  - {name: L4, uuid: X}\n", {}, "the same device"),
        ("gpu: []\n", {}, "unknown field(s) gpu"),
        ("cpus: -1\n", {}, "cpus: expected a positive number"),
        ("gpus:\n  - L4\n", {"CORRAL_GPUS": "3"}, "CORRAL_GPUS (--gpus): no GPU '3'"),
    ],
)
def test_bad_declared_inventory(tmp_path: Path, text: str, env: dict, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(InventoryError) as caught:
        load_inventory({"CORRAL_INVENTORY": str(path), **env})
    assert message in str(caught.value)


def test_a_bad_inventory_file_is_named_by_its_path(tmp_path: Path) -> None:
    path = _write(tmp_path, "gpus: [NVIDIA L4\n")
    with pytest.raises(InventoryError) as caught:
        load_inventory({"CORRAL_INVENTORY": str(path)})
    assert f'in "{path}", line' in str(caught.value) and "<unicode string>" not in str(caught.value)


def test_capacity_hands_a_retired_replicas_devices_to_its_successor(tmp_path: Path) -> None:
    """A rolling update on a full machine (corral.capacity, real SQLite): the claim of the old
    replica retired to make room goes to the new one, which launches only once the old one is
    torn down; a replica of another service waiting for the same device never gets it."""
    store = Store(tmp_path / "state.db")
    machine = Inventory((Gpu(0, "NVIDIA L4", "GPU-l4"),), 2, GiB)
    capacity = Capacity(store, machine)
    for name in ("svc-r", "svc-w"):
        store.create_service(name, "run: x\n", source=None, base_dir=None, lb_port=None)
    ask = {"accelerators": ["L4:1"]}
    old = store.add_replica("svc-r", 1, "local", "test")
    assert isinstance(capacity.grant(old.id, ask), Grant)
    new = store.add_replica("svc-r", 2, "local", "test")
    waiter = store.add_replica("svc-w", 1, "local", "test")
    held = "needs 1x L4; the machine has 1 L4, it is held by svc-r replica"
    assert capacity.grant(new.id, ask) == f"{held} {old.id}"
    assert capacity.grant(waiter.id, ask) == f"{held} {old.id}"

    assert capacity.room(new.id, ask, [old.id]) == old.id
    blocked = capacity.grant(new.id, ask)
    assert capacity.waiting[new.id] == blocked  # status says why it waits from the handover on
    assert blocked == (
        f"no spare room: waits for svc-r replica {old.id} to stop (retired to make room for "
        "it: a rolling update on a full machine replaces one replica at a time)"
    )
    # handed over once, never twice: asked again (a daemon killed before the old replica's
    # retire was written), the answer is the same old replica, to finish the handover
    assert capacity.room(new.id, ask, [old.id]) == old.id
    assert capacity.room(new.id, {"accelerators": ["L4:1"]}, []) is None
    store.update_replica(old.id, teardown_state="succeeded")  # its teardown is done
    assert capacity.grant(waiter.id, ask) == f"{held} {new.id}"
    granted = capacity.grant(new.id, ask)
    assert isinstance(granted, Grant) and dict(granted.claim.gpus) == {"GPU-l4": 1.0}
    assert granted.env["CUDA_VISIBLE_DEVICES"] == "GPU-l4"
    # the replica's row going (down, scale-down) frees its claim with it
    store.delete_replica(new.id)
    assert isinstance(capacity.grant(waiter.id, ask), Grant)
    store.close()


def test_a_rolling_update_that_could_never_be_placed_is_found_before_it_starts(
    tmp_path: Path,
) -> None:
    """capacity.room_in_turn plays a rolling update out on the claims (real SQLite): one old
    replica retired before each successor is all a full machine gets. A new replica that
    needs two old replicas' devices, or devices another service holds, could never start."""
    store = Store(tmp_path / "state.db")
    machine = Inventory(
        (Gpu(0, "NVIDIA A100", "GPU-a"), Gpu(1, "NVIDIA A100", "GPU-b"), Gpu(2, "NVIDIA L4", "L")),
        2,
        GiB,
    )
    capacity = Capacity(store, machine)
    for name in ("svc-r", "svc-o"):
        store.create_service(name, "run: x\n", source=None, base_dir=None, lb_port=None)
    one = {"accelerators": ["A100:1"]}
    olds = [store.add_replica("svc-r", 1, "local", "test") for _ in range(2)]
    for r in olds:
        assert isinstance(capacity.grant(r.id, one), Grant)
    # the same ask: each successor takes the claim of the old one retired for it
    assert capacity.room_in_turn("svc-r", one, 2) is None
    # fewer, bigger replicas: the surplus old one goes first, then the two A100s fit
    assert capacity.room_in_turn("svc-r", {"accelerators": ["A100:2"]}, 1) is None
    two = capacity.room_in_turn("svc-r", {"accelerators": ["A100:2"]}, 2)
    assert two is not None and two.startswith("new replica 1 of 2 needs 2x A100; "), two
    # the L4 is another service's: retiring svc-r's replicas frees none
    other = store.add_replica("svc-o", 1, "local", "test")
    assert isinstance(capacity.grant(other.id, {"accelerators": ["L4:1"]}), Grant)
    l4 = capacity.room_in_turn("svc-r", {"accelerators": ["L4:1"]}, 1)
    held = f"the machine has 1 L4, it is held by svc-o replica {other.seq}"
    assert l4 == f"new replica 1 of 1 needs 1x L4; {held}", l4
    # a replica being torn down frees its claim whatever the update does
    store.update_replica(olds[0].id, teardown_state="pending")
    assert capacity.room_in_turn("svc-r", {"accelerators": ["A100:2"]}, 1) is None
    assert capacity.room_in_turn("svc-r", {}, 5) is None  # asks nothing: always placed
    store.close()


@pytest.mark.parametrize(
    ("written", "options"),
    [
        ('"{L4, A10G, A100}:1"', ["L4:1", "A10G:1", "A100:1"]),
        ('"[A100, L4]:2"', ["A100:2", "L4:2"]),
        ("{L4: 1, A100: 1}", ["L4:1", "A100:1"]),
        ("[A100:1, L4:2]", ["A100:1", "L4:2"]),
        ("A100:0.5", ["A100:0.5"]),
    ],
)
def test_spec_forms_of_alternatives(written: str, options: list[str]) -> None:
    spec = parse_spec(f"name: x\nrun: y\nresources:\n  accelerators: {written}\n", source="t")
    assert spec.resources.accelerators == options
    ask = ask_of(spec.resources.model_dump(exclude_none=True))
    assert [f"{o.model}:{o.count:g}" for o in ask.options] == options


def test_a_claim_survives_a_restart_and_is_never_given_twice(tmp_path: Path) -> None:
    """What a relaunch after a daemon restart relies on: the same replica gets the claim it
    already had (from the file, by a new Store), and a new replica only what is left."""
    path = tmp_path / "state.db"
    machine = Inventory((Gpu(0, "NVIDIA L4", "GPU-0"), Gpu(1, "NVIDIA L4", "GPU-1")), 2, GiB)
    ask = {"accelerators": ["L4:1"]}
    store = Store(path)
    store.create_service("s", "run: x\n", source=None, base_dir=None, lb_port=None)
    first = store.add_replica("s", 1, "local", "test")
    granted = Capacity(store, machine).grant(first.id, ask)
    assert isinstance(granted, Grant) and list(granted.claim.gpus) == ["GPU-0"]
    store.close()

    store = Store(path)  # the next daemon
    capacity = Capacity(store, machine)
    again = capacity.grant(first.id, ask)
    assert isinstance(again, Grant) and again.claim == granted.claim
    second = store.add_replica("s", 1, "local", "test")
    other = capacity.grant(second.id, ask)
    assert isinstance(other, Grant) and list(other.claim.gpus) == ["GPU-1"]
    third = store.add_replica("s", 1, "local", "test")
    assert capacity.grant(third.id, ask) == (
        f"needs 1x L4; the machine has 2 L4, both held by s replicas {first.id} and {second.id}"
    )
    store.close()


def test_a_fixed_port_is_held_by_one_replica_at_a_time() -> None:
    """A `run` that binds its port itself (corral.infra.local_rules.claim_resources adds it)
    claims it like a device: a second replica on it waits, naming the holder, and a claim
    stored before ports were claimed holds none."""
    ask = ask_of({"fixed_port": 8080, "cpus": 1})
    assert ask.ports == (8080,) and not ask_of({"fixed_port": 8080}).empty
    first = place(ask, MACHINE, [holder("other", 7, ports=(9090,))])
    assert isinstance(first, Claim) and first.ports == (8080,)
    assert Claim.from_json(first.to_json()) == first
    assert Claim.from_json({"cpus": 1}).ports == ()
    second = place(ask, MACHINE, [Holder("web", 3, first, 1)])
    assert isinstance(second, NoFit)
    assert second.reason == (
        "binds port 8080 itself (its `run` ignores $PORT), which web replica 1 holds: one "
        "process at a time can bind it"
    )
