"""``torchparity golden show``: what a zoo case's goldens were made from, and their tensors."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.table import Table

from torchparity.golden.cases import OUTPUT_KINDS
from torchparity.golden.report import print_table
from torchparity.golden.store import GoldenStore
from torchparity.reference import TransformerConfig
from torchparity.reference.zoo import ZooCase


def show_golden(store: GoldenStore, case: ZooCase, console: Console) -> None:
    """Print what ``case``'s goldens were made from and a table of each output's tensors.

    Raises:
        GoldenError: a golden is missing or damaged.
    """
    goldens = {output: store.read(case.name, output) for output in OUTPUT_KINDS}
    summary = goldens["logits"].summary
    console.print(f"[bold]{case.name}[/bold]: {summary.get('description', case.description)}")
    console.print(f"folder: {store.root / case.name}", markup=False)
    console.print(f"config (fields differing from the defaults): "
                  f"{_config_text(summary.get('config'))}", markup=False)
    inputs = summary.get("inputs", {})
    console.print(f"inputs: batch {inputs.get('batch_size')} x {inputs.get('seq_len')} tokens, "
                  f"{inputs.get('padding')} padding; seeds {summary.get('seeds')}; "
                  f"{summary.get('decode_steps')} decode steps", markup=False)
    for what, digest in (summary.get("checksums") or {}).items():
        console.print(f"{what} checksum: {digest}", markup=False)
    produced = summary.get("produced_by", {})
    console.print("produced by: " + ", ".join(f"{k} {v}" for k, v in produced.items()),
                  markup=False)
    for output, golden in goldens.items():
        table = Table(title=f"{output} ({golden.summary.get('kind')})", title_justify="left")
        for column in ("tensor", "shape", "dtype", "mean", "std", "absmax"):
            table.add_column(column, justify="left" if column == "tensor" else "right",
                             no_wrap=True)
        for name, info in golden.summary["tensors"].items():
            table.add_row(name, "x".join(map(str, info["shape"])) or "scalar", info["dtype"],
                          *(_number(info[k]) for k in ("mean", "std", "absmax")))
        print_table(console, table)


def _config_text(config: object) -> str:
    if not isinstance(config, dict):
        return "(none recorded)"
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    changed = [f"{k}={v}" for k, v in config.items() if defaults.get(k, object()) != v]
    return ", ".join(changed) or "(all defaults)"


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)

