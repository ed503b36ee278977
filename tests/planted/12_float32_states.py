"""model_state_bytes computed in float32 (then turned into Python floats): 70e9 x 16 loses
its last digits."""
import numpy as np

EXPECT = {"12.1": "float32's rounding"}
RANKS = 1


def model_state_bytes(psi, n_d, stage, accounting="zero"):
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    w, g, k = {"zero": (2, 2, 12), "megatron": (2, 4, 12), "fp32": (4, 4, 8)}[accounting] \
        if isinstance(accounting, str) else accounting
    psi, part = np.float32(psi), np.float32(psi) / np.float32(n_d)
    return {"weights": float(w * (part if stage == 3 else psi)),
            "grads": float(g * (part if stage >= 2 else psi)),
            "optimizer": float(k * (part if stage >= 1 else psi))}
