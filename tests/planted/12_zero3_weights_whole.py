"""model_state_bytes whose stage 3 forgets to divide the weights."""

EXPECT = {"12.1": "stage 3 cuts the weights too"}
RANKS = 1


def model_state_bytes(psi, n_d, stage, accounting="zero"):
    if stage not in (0, 1, 2, 3):
        raise ValueError(stage)
    w, g, k = {"zero": (2, 2, 12), "megatron": (2, 4, 12), "fp32": (4, 4, 8)}[accounting] \
        if isinstance(accounting, str) else accounting
    return {"weights": w * psi,
            "grads": g * psi / n_d if stage >= 2 else g * psi,
            "optimizer": k * psi / n_d if stage >= 1 else k * psi}
