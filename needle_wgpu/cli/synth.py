"""``needle-wgpu synth``: write a seeded synthetic Needle 3 file (``needle_wgpu.synth``)."""

from __future__ import annotations

import argparse
import sys

from ..errors import NeedleError
from ..sampling import saturate_seed
from ..synth import GEOMETRIES, synthesize
from .options import join_option_values


def synth_main(argv: list) -> int:
    """``synth --geometry {tiny,small,shipped} --seed N -o FILE.cact``; returns an exit status.
    The seed saturates as a sampling seed does (-1 -> 2^32 - 1, NaN -> 0)."""
    parser = argparse.ArgumentParser(prog="needle-wgpu synth",
                                     description="Write a seeded random Needle 3 .cact v3 model.")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    parser.add_argument("--seed", type=saturate_seed, default=0)
    parser.add_argument("--no-heads", action="store_true", help="omit the confidence probe head")
    parser.add_argument("-o", "--output", required=True, help="path of the .cact file to write")
    try:
        args = parser.parse_args(join_option_values(parser, argv))
    except SystemExit as exit_request:  # --help, or a usage error already printed by argparse
        return int(exit_request.code or 0)
    try:
        data = synthesize(args.geometry, args.seed, heads=not args.no_heads)
        with open(args.output, "wb") as f:
            f.write(data)
    except (OSError, NeedleError) as exc:
        print(f"needle-wgpu synth: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {args.geometry} geometry, seed {args.seed}, {len(data):,} bytes")
    return 0
