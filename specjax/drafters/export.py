"""`specjax export`: a drafter in a format vLLM and SGLang load.

* EAGLE-3 -> `eagle` (EAGLE / SpecForge, what SGLang serves) or `speculators` (vLLM); see
  eagle3_formats.py. The `speculators` layout names its verifier (target), whose tables its
  loaders read: `verifier` (a hub id or a path) is written there.
* a draft model -> `hf`: a plain HF Llama-family checkpoint (a distilled one gets the target's
  embedding and head it borrows), what `--speculative-config '{"model": DIR}'` and SGLang's
  `--speculative-draft-model-path` take.
* DFlash -> `zlab`: z-lab's `DFlashDraftModel` layout (dflash_formats.py), what vLLM's and SGLang's
  `dflash` method loads.
* DSpark -> `speculators` (vLLM) or `specforge` (SpecForge's `DSparkDraftModel`); see
  dspark_formats.py.

MTP modules trained by specjax have no published layout (published MTP layers live inside their
target's checkpoint); asking for one is a one-line error.
"""

from __future__ import annotations

import os

from specjax.drafters import KINDS, make_drafter, split_spec
from specjax.errors import DrafterError

FORMATS = {k.name: k.export_formats for k in KINDS.values() if k.export_formats}
# The hub id of the embedded default model: the verifier a `speculators` export for it names.
DEFAULT_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def export_drafter(
    spec: str,
    fmt: str,
    out_dir: str,
    model_path: str | None = None,
    dtype: str = "bfloat16",
    verifier: str | None = None,
) -> str:
    """Write the drafter `spec` (as `--drafter` takes it) for the target `model_path` to
    `out_dir` (new or empty) in `fmt`; returns `out_dir`."""
    from specjax.models.loading import load_model

    kind, _ = split_spec(spec)
    if kind not in FORMATS:
        can = ", ".join(f"{k} -> {' | '.join(f)}" for k, f in FORMATS.items())
        raise DrafterError(f"{kind!r} drafters have no published format to export to (exportable: {can})")
    if fmt not in FORMATS[kind]:
        raise DrafterError(f"--format {fmt!r}: a {kind} drafter exports as {' | '.join(FORMATS[kind])}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise DrafterError(f"--out {out_dir}: exists and is not an empty directory (nothing is overwritten)")
    target = load_model(model_path, "float32", quiet=True)
    drafter = make_drafter(spec, 0, target)  # checks that it was trained for this target
    if kind == "draft":
        import dataclasses

        from specjax.models.loading.export import save_hf

        draft = drafter.model
        if draft.tokenizer is None:  # the target's (a draft model shares its tokenizer)
            draft = dataclasses.replace(draft, tokenizer=target.tokenizer)
        return save_hf(draft, out_dir, dtype)
    if kind == "dflash":
        import jax.numpy as jnp

        from specjax.drafters import dflash_formats

        return dflash_formats.export(drafter.weights, out_dir, jnp.dtype(dtype))
    import jax.numpy as jnp

    meta = _verifier(target, model_path, verifier) if fmt == "speculators" else None
    if kind == "dspark":
        from specjax.drafters import dspark_formats
        from specjax.drafters.base import head_rows

        head = head_rows(target.module().head_weight(), drafter.weights.d2t)  # [N, D] the rows it drafts from
        return dspark_formats.export(drafter.weights, out_dir, fmt, head=head, verifier=meta, dtype=jnp.dtype(dtype))
    from specjax.drafters import eagle3_formats

    return eagle3_formats.export(
        drafter.weights,
        out_dir,
        fmt,
        embed=target.params["embed"][...],
        verifier=meta,
        num_draft=drafter.num_draft,
        dtype=jnp.dtype(dtype),
        max_positions=target.config.max_position_embeddings,
    )


def _verifier(target, model_path: str | None, verifier: str | None) -> dict:
    """The verifier a `speculators` config names: `verifier`, else the target's HF directory, else
    the default model's hub id."""
    name = verifier or (model_path if model_path and os.path.isdir(model_path) else None)
    name = name or (DEFAULT_MODEL_HUB_ID if model_path is None else None)
    if name is None:
        raise DrafterError(
            "--verifier NAME_OR_PATH is needed: a speculators checkpoint names its target (a hub id or an HF directory)"
        )
    return {"name_or_path": name, "architectures": [target.config.to_hf()["architectures"][0]]}
