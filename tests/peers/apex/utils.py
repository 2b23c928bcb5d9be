# Adapted from NVIDIA/apex, tests/L0/run_amp/utils.py at commit e13873d (the parent of cb65b8e,
# "remove old features: amp, ddp, and rnn (#1896)"); Apex's license: see __init__.py.
# Changed: the device. Apex's tests ran on CUDA (default tensor type torch.cuda.FloatTensor);
# these run on the CPU, so the type strings are the CPU ones and the default stays as it is.
import torch

HALF = "torch.HalfTensor"
FLOAT = "torch.FloatTensor"

DTYPES = [torch.half, torch.float]

ALWAYS_HALF = {torch.float: HALF, torch.half: HALF}
ALWAYS_FLOAT = {torch.float: FLOAT, torch.half: FLOAT}
MATCH_INPUT = {torch.float: FLOAT, torch.half: HALF}


def common_init(test_case):
    test_case.h = 64
    test_case.b = 16
    test_case.c = 16
    test_case.k = 3
    test_case.t = 10
