"""``torchparity backends``: which attention backends run here, per dtype, and why not.

Each backend is probed with a causal call without a mask and with a masked call; "ok" means
either ran. A model's calls are still judged one by one (flash may run the first kind and
refuse the second)."""

from __future__ import annotations

import argparse
import json

import torch
from rich.console import Console
from rich.table import Table

from torchparity import backends
from torchparity.commands.common import dtype_name, resolve_device
from torchparity.dtypes import CASTABLE, DTYPES
from torchparity.text import print_trimmed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="device to probe (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", action="append", type=dtype_name, choices=list(CASTABLE),
                        help="dtype to probe (repeatable; default: all)")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    dtypes = args.dtype or list(CASTABLE)
    results = {name: backends.available(device, DTYPES[name]) for name in dtypes}

    table = Table(title=f"attention backends on {device} (torch {torch.__version__})")
    table.add_column("backend")
    for name in dtypes:
        table.add_column(name)
    notes: dict[str, int] = {}
    for backend in backends.names():
        cells = []
        for name in dtypes:
            reason = results[name][backend]
            if reason is None:
                cells.append("[green]ok[/]")
            else:
                index = notes.setdefault(reason, len(notes) + 1)
                cells.append(f"[red]n/a[/] [{index}]")
        table.add_row(backend, *cells)
    console = Console()
    print_trimmed(console, table)
    for reason, index in notes.items():
        print_trimmed(console, f"[{index}] {reason}")
    print_trimmed(console, "ok: ran a causal call without a mask or a masked call; a model's "
                           "calls are judged one by one.")

    if args.json:
        payload = {"device": device, "torch": torch.__version__, "available": results}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
