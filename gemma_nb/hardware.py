"""Instances and accelerators, and whether a memory plan fits one (notebook 01; figures' sources:
docs/sources.md). HBM per NeuronCore is 16 GiB (AWS, ``budget="spec"``); the story's arithmetic says
16 GB (``budget="story"``)."""

from typing import NamedTuple

import pandas as pd

GB = 10**9
GiB = 2**30
TERA = 10**12
STORY_HBM_PER_CORE_BYTES = 16 * GB  # "32 GB HBM = 16 GB per core" (the story's words)


class Instance(NamedTuple):
    """One EC2 instance type. Memory in GiB as AWS lists it; ``usd_per_hour`` on-demand
    (us-east-1)."""

    name: str
    chips: int
    neuron_cores: int
    vcpus: int
    host_ram_gib: float
    hbm_gib: float
    usd_per_hour: float

    # a chip: 2 cores, 32 GiB
    hbm_per_core_bytes = property(lambda self: int(self.hbm_gib * GiB) // self.neuron_cores)
    host_ram_bytes = property(lambda self: int(self.host_ram_gib * GiB))

    def budget_bytes(self, budget: str = "spec") -> int:
        assert budget in ("spec", "story"), f"budget {budget!r} is not one of spec, story"
        return self.hbm_per_core_bytes if budget == "spec" else STORY_HBM_PER_CORE_BYTES


# docs/sources.md: inf2-instances (chips, cores, memory), ec2-pricing (us-east-1 Linux on-demand
# $/h).
INSTANCES: dict[str, Instance] = {
    i.name: i
    for i in (
        Instance(
            "inf2.xlarge",
            chips=1,
            neuron_cores=2,
            vcpus=4,
            host_ram_gib=16,
            hbm_gib=32,
            usd_per_hour=0.7582,
        ),
        Instance(
            "inf2.8xlarge",
            chips=1,
            neuron_cores=2,
            vcpus=32,
            host_ram_gib=128,
            hbm_gib=32,
            usd_per_hour=1.9679,
        ),
        Instance(
            "inf2.24xlarge",
            chips=6,
            neuron_cores=12,
            vcpus=96,
            host_ram_gib=384,
            hbm_gib=192,
            usd_per_hour=6.4906,
        ),
        Instance(
            "inf2.48xlarge",
            chips=12,
            neuron_cores=24,
            vcpus=192,
            host_ram_gib=768,
            hbm_gib=384,
            usd_per_hour=12.9813,
        ),
    )
}


def get_instance(name: str | Instance) -> Instance:
    if isinstance(name, Instance):
        return name
    if name not in INSTANCES:
        raise ValueError(f"instance {name!r} is not in the catalog; known: {', '.join(INSTANCES)}")
    return INSTANCES[name]


def instance_table():
    """The inf2 catalog as a DataFrame, HBM per core in both GiB (spec) and GB (10^9 bytes)."""
    table = pd.DataFrame(INSTANCES.values()).rename(columns={"name": "instance"})
    per_core_bytes = [inst.hbm_per_core_bytes for inst in INSTANCES.values()]
    before_price = table.columns.get_loc("usd_per_hour")
    table.insert(before_price, "hbm_per_core_gib", [n / GiB for n in per_core_bytes])
    table.insert(before_price + 1, "hbm_per_core_gb", [round(n / GB, 3) for n in per_core_bytes])
    return table


class Device(NamedTuple):
    """One accelerator (or a slice of one) for roofline estimates: peak figures per second, None
    where unknown."""

    name: str
    hbm_bytes: int | None
    bandwidth_bytes_s: float | None
    bf16_flops: float | None
    usd_per_hour: float | None
    source: str


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            "inferentia2_chip",
            hbm_bytes=32 * GiB,
            bandwidth_bytes_s=820 * GiB,
            bf16_flops=190 * TERA,
            usd_per_hour=None,
            source="inferentia2-arch (AWS: 32 GiB HBM at 820 GiB/s, 190 TFLOPS bf16, 380 INT8 "
            "TOPS)",
        ),
        Device(
            "neuroncore_v2",
            hbm_bytes=16 * GiB,
            bandwidth_bytes_s=410 * GiB,
            bf16_flops=95 * TERA,
            usd_per_hour=INSTANCES["inf2.xlarge"].usd_per_hour / 2,
            source="half an Inferentia2 chip (2 NeuronCore-v2 per chip); $/h = inf2.xlarge / 2 "
            "cores",
        ),
        Device(
            "tpu_v6e_chip",
            hbm_bytes=32 * GB,
            bandwidth_bytes_s=1638 * GB,
            bf16_flops=918 * TERA,
            usd_per_hour=2.70,
            source="tpu-v6e (Google: 918 bf16 TFLOPS, 32 GB at 1638 GB/s, $2.70/chip-h)",
        ),
        Device(
            "h200",
            hbm_bytes=141 * GB,
            bandwidth_bytes_s=4.8 * TERA,
            bf16_flops=790 * TERA,
            usd_per_hour=None,
            source="h200 (141 GB HBM3e ~4.8 TB/s spec, ~4.3 TB/s measured copy; ~790 TFLOP/s "
            "bf16 measured)",
        ),
    )
}


def measured_cpu(bandwidth_bytes_s: float, ram_bytes: int | None = None) -> Device:
    """A ``Device`` for the machine a notebook runs on, from the bandwidth that notebook
    measured."""
    assert bandwidth_bytes_s and bandwidth_bytes_s > 0, (
        f"bandwidth_bytes_s={bandwidth_bytes_s!r} must be a positive bandwidth"
    )
    return Device(
        "this_cpu",
        ram_bytes,
        float(bandwidth_bytes_s),
        None,
        usd_per_hour=None,
        source="measured here",
    )


class Fit(NamedTuple):
    """Whether a per-rank plan fits one instance, one rank per NeuronCore; ``headroom_bytes`` is
    None with too few cores."""

    instance: str
    neuron_cores: int
    fits: bool
    used_bytes: int
    budget_bytes: int
    headroom_bytes: int | None
    replicas: int
    usd_per_hour: float
    reason: str

    headroom_gb = property(
        lambda self: None if self.headroom_bytes is None else self.headroom_bytes / GB
    )


def fits(plan, instance: str | Instance, budget: str = "spec") -> Fit:
    """Does ``plan`` (``total_bytes`` per rank at ``plan.tp``) fit ``instance``, and with how much
    headroom per core?"""
    inst = get_instance(instance)
    budget_bytes, used = inst.budget_bytes(budget), int(plan.total_bytes)
    headroom, ok = budget_bytes - used, budget_bytes >= used
    reason = (
        f"{headroom / GB:.2f} GB free per NeuronCore"
        if ok
        else f"short by {-headroom / GB:.2f} GB per NeuronCore"
    )
    if plan.tp > inst.neuron_cores:
        headroom, ok, reason = (
            None,
            False,
            f"TP={plan.tp} needs {plan.tp} NeuronCores; {inst.name} has {inst.neuron_cores}",
        )
    return Fit(
        inst.name,
        inst.neuron_cores,
        ok,
        used,
        budget_bytes,
        headroom,
        inst.neuron_cores // plan.tp,
        inst.usd_per_hour,
        reason,
    )
