"""Re-run the planner's calibration table on constants measured by ``gpu_check.py --only costmodel``.

    python scripts/gpu_checks/calibrate.py --gpu-json DIR/gpu_check.json [--out table.md] [--refit]

Reads the ``costmodel/measured_constants`` record, predicts every published run
(``rayfleet/placement/calibration/published_runs.yaml``) with ``CostParams()`` (the assumed
constants) and with the measured ones, and prints a markdown table of step times and errors
(error = predicted / published - 1 in step time; the benchmark's tokens/s error has the other sign).

Which measurements replace which constants, and why (only where they are the same quantity):
- ``bf16_gemm_efficiency`` <- the large square BF16 GEMM: the constant is itself a measured
  large-GEMM efficiency (``CostParams`` docstring), so the measurement replaces it outright.
- ``attention_efficiency`` <- SDPA's fwd+bwd efficiency with the model's FLOP count (the best
  backend measured: the published runs used Transformer Engine's fused kernel, not rayfleet's
  default pick), the quantity the model divides attention FLOPs by.
- ``gemm_rows_at_half_efficiency`` <- the fitted knee of the grouped BF16 expert GEMM (``bmm`` of
  8 local experts at Qwen3-235B's expert shape, equal rows each): the same ``rows / (rows + knee)``
  form per expert of a grouped GEMM. A raw kernel's knee leaves out what a step adds (small-K
  weight-gradient GEMMs; FP8's larger knee, no FP8 grouped GEMM being timed), so the measured
  column is optimistic for small experts where those matter.
- HBM: the model prices HBM-bound terms at 100% of the catalogue's bandwidth and has no constant
  for it; the measured column scales the catalogue entry of each run's accelerator by the
  measured fraction (a fraction, so an H200's measurement transfers to the H100 rows) while the
  table is computed, and restores it after.
- ``gemm_efficiency`` is NOT replaced: it is fitted on whole FP8 runs and carries what they add to
  a raw GEMM; the raw ``_scaled_mm`` figure is its ceiling (judged in ``costmodel.py``). With
  ``--refit`` the table gains a column where the fitted constants (all of ``FITTED_FIELDS`` except
  the replaced ones) are refitted on the fit rows with the measured constants held, regularised
  toward the measured FP8 ceiling with casts and the measured attention efficiency
  (``fit_efficiency``'s priors), i.e. the calibration redone on this GPU's truth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rayfleet.placement.calibration import FITTED_FIELDS, fit_efficiency, load_published_runs, predict_run  # noqa: E402
from rayfleet.placement.cost_params import CostParams  # noqa: E402
from rayfleet.platform import catalogue  # noqa: E402

__all__ = ["measured_params", "calibration_rows", "markdown_table", "main"]


def measured_params(measured: dict[str, Any], base: CostParams = CostParams()) -> tuple[CostParams, tuple[str, ...]]:
    """``base`` with the measured constants that are the same quantity; also their names."""
    fields: dict[str, float] = {"bf16_gemm_efficiency": float(measured["bf16_gemm_efficiency"])}
    if measured.get("attention_efficiency_best") is not None:
        fields["attention_efficiency"] = float(measured["attention_efficiency_best"])
    if measured.get("gemm_rows_at_half_efficiency") is not None:
        fields["gemm_rows_at_half_efficiency"] = float(measured["gemm_rows_at_half_efficiency"])
    return replace(base, **fields), tuple(fields)


@contextlib.contextmanager
def _hbm_scaled(names: set[str], fraction: float) -> Iterator[None]:
    """Temporarily scale the catalogue's HBM bandwidth of ``names`` by ``fraction`` (restored on exit)."""
    saved = {n: catalogue.CATALOGUE[n] for n in names}
    try:
        for n, spec in saved.items():
            catalogue.CATALOGUE[n] = replace(spec, hbm_bandwidth_gbps=spec.hbm_bandwidth_gbps * fraction)
        yield
    finally:
        catalogue.CATALOGUE.update(saved)


def calibration_rows(measured: dict[str, Any], *, refit: bool = False) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """One dict per published run: published and predicted step seconds under the assumed and the
    measured constants (and the refit, with ``refit``), with the errors. Also the replaced names."""
    runs = load_published_runs()
    assumed = CostParams()
    params, replaced = measured_params(measured, assumed)
    hbm = float(measured.get("hbm_fraction", 1.0))
    refitted = None
    with _hbm_scaled({r.hardware for r in runs}, hbm):
        if refit:
            priors = {"attention_efficiency": params.attention_efficiency}
            if measured.get("fp8_gemm_ceiling_with_cast"):
                priors["gemm_efficiency"] = float(measured["fp8_gemm_ceiling_with_cast"])
            refitted = fit_efficiency([r for r in runs if r.fit], params, priors=priors,
                                      fields=[f for f in FITTED_FIELDS if f not in replaced])
        measured_steps = {r.id: predict_run(r, params).cost.step_time_s for r in runs}
        refit_steps = {r.id: predict_run(r, refitted).cost.step_time_s for r in runs} if refitted else {}
    rows = []
    for r in runs:
        row = {"run": r.id, "set": "fit" if r.fit else "held out", "precision": r.model.precision, "hardware": r.hardware,
               "published_step_s": r.step_time_s, "assumed_step_s": predict_run(r, assumed).cost.step_time_s,
               "measured_step_s": measured_steps[r.id]}
        row["assumed_error"] = row["assumed_step_s"] / r.step_time_s - 1
        row["measured_error"] = row["measured_step_s"] / r.step_time_s - 1
        if refitted:
            row["refit_step_s"] = refit_steps[r.id]
            row["refit_error"] = refit_steps[r.id] / r.step_time_s - 1
        rows.append(row)
    if refitted:
        rows.append({"run": "refitted constants", **{f: getattr(refitted, f) for f in FITTED_FIELDS}})
    return rows, replaced + ("hbm_fraction",)


def markdown_table(rows: list[dict[str, Any]], measured: dict[str, Any]) -> str:
    """The rows as a markdown table with a header naming the constants and the device."""
    runs = [r for r in rows if "published_step_s" in r]
    refit = any("refit_step_s" in r for r in runs)
    assumed = CostParams()
    params, _ = measured_params(measured, assumed)
    lines = [f"Calibration re-run on constants measured on {measured.get('gpu', '?')} "
             f"(catalogue {measured.get('catalogue', '?')})"
             + ("" if measured.get("on_cuda") else " -- CPU figures: the code path only, not a calibration")
             + f"; applied as fractions of peak (HBM: of the catalogue's bandwidth) to the "
             f"{', '.join(sorted({r['hardware'] for r in runs}))} rows.",
             "",
             f"assumed: bf16_gemm_efficiency {assumed.bf16_gemm_efficiency}, attention_efficiency "
             f"{assumed.attention_efficiency}, gemm_rows_at_half_efficiency {assumed.gemm_rows_at_half_efficiency:g}, "
             "HBM 1.0 of the catalogue; measured: bf16_gemm_efficiency "
             f"{params.bf16_gemm_efficiency:.3f}, attention_efficiency {params.attention_efficiency:.3f}, "
             f"gemm_rows_at_half_efficiency {params.gemm_rows_at_half_efficiency:.0f}, HBM "
             f"{float(measured.get('hbm_fraction', 1.0)):.3f}; gemm_efficiency {assumed.gemm_efficiency} kept "
             "(fitted end to end" + (f"; raw FP8 ceiling with casts {measured['fp8_gemm_ceiling_with_cast']:.3f}"
                                      if measured.get("fp8_gemm_ceiling_with_cast") else "") + ").",
             "",
             "| run | set | precision | published step (s) | predicted, assumed (s) | error | predicted, measured (s) "
             "| error |" + (" predicted, refit (s) | error |" if refit else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if refit else "")]
    for r in runs:
        lines.append(f"| {r['run']} | {r['set']} | {r['precision']} | {r['published_step_s']:.2f} | "
                     f"{r['assumed_step_s']:.2f} | {r['assumed_error']:+.1%} | {r['measured_step_s']:.2f} | "
                     f"{r['measured_error']:+.1%} |"
                     + (f" {r['refit_step_s']:.2f} | {r['refit_error']:+.1%} |" if refit else ""))
    columns = [("assumed", "assumed_error"), ("measured", "measured_error")] + ([("refit", "refit_error")] if refit else [])
    lines.append("")
    for label, key in columns:
        for name, subset in (("fit rows", [r for r in runs if r["set"] == "fit"]), ("all rows", runs)):
            worst = max(subset, key=lambda r: abs(r[key]))
            lines.append(f"- {label}, {name}: worst |error| {abs(worst[key]):.1%} ({worst['run']}), mean |error| "
                         f"{sum(abs(r[key]) for r in subset) / len(subset):.1%}")
    fitted = next((r for r in rows if r.get("run") == "refitted constants"), None)
    if fitted:
        lines.append("- refitted: " + ", ".join(f"{k} {v:g}" for k, v in fitted.items() if k != "run"))
    return "\n".join(lines)


def _measured_from(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    for result in doc.get("results", []):
        if result["group"] == "costmodel" and result["name"] == "measured_constants":
            return result["figures"]
    raise SystemExit(f"{path}: no costmodel/measured_constants record; run "
                     "`python scripts/gpu_check.py --out DIR --only costmodel` first")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-json", required=True, type=Path, help="gpu_check.json with a costmodel group")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--refit", action="store_true",
                        help="add a column refitted with the measured constants held (slower: a coordinate search)")
    args = parser.parse_args(argv)
    measured = _measured_from(args.gpu_json)
    started = time.monotonic()
    rows, _ = calibration_rows(measured, refit=args.refit)
    table = markdown_table(rows, measured)
    print(table)
    print(f"\n({time.monotonic() - started:.1f} s)")
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
