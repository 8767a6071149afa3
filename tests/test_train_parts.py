"""The trainer's small parts: the chip-peak table behind MFU and the logging window's device accumulators."""

import pytest
import torch

from dflash.train.fit.metrics import TrainMetrics
from dflash.train.fit.schedule import peak_flops


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("Some Future GPU", None)])
def test_peak_flops_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda:0")) == peak


def test_no_peak_and_so_no_mfu_on_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_metrics_add_read_reset():
    m = TrainMetrics.zeros(slots=3, micro_steps=4, device="cpu")
    for loss, tau in ((2.0, 1.5), (4.0, 2.5)):
        m.add({"loss": torch.tensor(loss), "tau": torch.tensor(tau), "slot_acc": torch.tensor([1.0, 0.5, 0.0]),
               "slot_count": torch.tensor([2.0, 2.0, 1.0])})
    m.add_grad_norm(torch.tensor(0.25, dtype=torch.bfloat16))
    sums, losses = m.read()
    assert float(sums["loss"]) == 6.0 and float(sums["tau"]) == 4.0 and float(sums["grad_norm"]) == 0.25
    assert sums["slot_hits"].tolist() == [4.0, 2.0, 0.0] and sums["slot_count"].tolist() == [4.0, 4.0, 2.0]
    assert losses.tolist() == [2.0, 4.0]
    m.reset()
    sums, losses = m.read()
    assert all(float(v.abs().sum()) == 0 for v in sums.values()) and losses.numel() == 0
