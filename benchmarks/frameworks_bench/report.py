"""The checks, the peak settled against the link, and the table."""

from __future__ import annotations

from frameworks_bench.common import SKYRL_OPS, TARGET_FRAC
from frameworks_bench.context import Run


# --------------------------------------------------------------------------------------------- report
def _checks(result: dict) -> dict:
    """The bars the run is held to: each patched full-state path at >= TARGET_FRAC of the peak, the
    forward-only patched offloads copying nothing after the first, every round trip bit-exact."""
    fw = result["frameworks"]
    sky, ar = fw.get("skyrl", {}), fw.get("areal", {})
    entries, fwd, exact = [], {}, {}
    for name, r, ops in (("skyrl", sky, SKYRL_OPS), ("areal", ar, ("offload", "onload"))):
        done = ((r.get("paths") or {}).get("patched") or {}).get("ops")
        if r.get("available") and r.get("paths") is not None:
            entries += [(name, op, (done or {}).get(op, {}).get("frac_of_peak"),
                         (done or {}).get(op, {}).get("frac_of_peak_excluding_release")) for op in ops]
    for name, r in (("skyrl", sky), ("areal", ar)):
        for path in ("unpatched", "patched"):
            for key, node in ((f"{name}.{path}", (r.get("paths") or {}).get(path)),
                              (f"{name}.forward_only.{path}", (r.get("forward_only") or {}).get(path))):
                be = (node or {}).get("bit_exact")
                if isinstance(be, dict):
                    exact[key] = be.get("equal")
        fo = (r.get("forward_only") or {}).get("patched")
        if fo:
            fwd[name] = fo.get("copies_nothing_after_first")
    fracs = [f for _, _, f, _ in entries]
    fracs_x = [x if x is not None else f for _, _, f, x in entries]

    def at(vals):
        return None if not vals or any(v is None for v in vals) else all(v >= TARGET_FRAC for v in vals)

    return {
        "target_frac_of_peak": TARGET_FRAC,
        "patched_frac_of_peak": [{"framework": a, "op": b, "frac_of_peak": f,
                                  "at_target": None if f is None else f >= TARGET_FRAC,
                                  "frac_of_peak_excluding_release": x} for a, b, f, x in entries],
        "all_patched_at_target": at(fracs),
        "all_patched_at_target_excluding_release": at(fracs_x),
        "forward_only_copies_nothing_after_first": fwd,
        "bit_exact": exact,
        "all_bit_exact": all(v is True for v in exact.values()) if exact else None,
    }


def _settle_peak(result: dict, run: Run, after: dict) -> None:
    """The link peak is the faster of the measurements before and after the frameworks, per
    direction (the link's rate drifted by some 3% between runs, and a low first measurement put
    the frameworks' copies above it); every ``*frac_of_peak*`` computed against the first is
    rescaled to it. Both measurements stay in the JSON."""
    before = dict(result["link_peak_GBps"])
    settled = {k: max(before[k], after[k]) for k in ("h2d", "d2h", "bidir")}
    settled["nbytes"] = before["nbytes"]
    settled["before"], settled["after"] = before, after
    result["link_peak_GBps"] = settled
    result["link_peak_note"] = ("per direction the faster of two measurements (fastest of 5 bursts of 4 pinned "
                                "1 GiB copies each), one before and one after the frameworks, this process")
    run.peak = settled

    def rescale(summary: dict, direction: str) -> None:
        for k, v in list(summary.items()):
            if "frac_of_peak" in k and isinstance(v, (int, float)):
                summary[k] = v * before[direction] / settled[direction]

    for fw in result["frameworks"].values():
        for branch in ((fw.get("paths") or {}).values(), (fw.get("forward_only") or {}).values()):
            for path in branch:
                if isinstance(path, dict) and isinstance(path.get("ops"), dict):
                    for op, summary in path["ops"].items():
                        rescale(summary, "d2h" if op.startswith("offload") else "h2d")


def _flag_over_peak(result: dict, run: Run) -> None:
    def walk(node, path):
        if isinstance(node, dict):
            for key in ("frac_of_peak", "max_cycle_frac_of_peak", "first_frac_of_peak"):
                v = node.get(key)
                if isinstance(v, (int, float)) and v > 1.0:
                    run.flags.append(f"{path}.{key} = {v:.4f} > 1.0: faster than the link peak measured in this run "
                                     "(the peak or the timing is off; reported raw, not capped)")
            for k, v in node.items():
                if k != "checks":
                    walk(v, f"{path}.{k}" if path else k)

    walk(result.get("frameworks", {}), "frameworks")


def print_table(result: dict) -> None:
    rows = []
    fw = result["frameworks"]

    def add(name, path, op, s):
        if not s:
            return
        rows.append([name, path, op, f"{s['first_s']:.4f}",
                     f"{s['median_s']:.4f} [{s['min_s']:.4f}-{s['max_s']:.4f}]", f"{s['bytes'] / 1e9:.3f}",
                     "-" if s.get("GBps") is None else f"{s['GBps']:.1f}",
                     "-" if s.get("frac_of_peak") is None else f"{s['frac_of_peak']:.3f}",
                     "-" if s.get("release_median_s") is None else f"{s['release_median_s'] * 1e3:.1f}",
                     "-" if s.get("frac_of_peak_excluding_release") is None
                     else f"{s['frac_of_peak_excluding_release']:.3f}"])

    for name in ("skyrl", "areal"):
        r = fw.get(name, {})
        if not r.get("available"):
            rows.append([name, "-", f"skipped: {r.get('reason', '?')[:90]}", "", "", "", "", "", "", ""])
            continue
        if r.get("error"):
            rows.append([name, "-", f"failed part-way: {r['error'].splitlines()[0][:90]}", "", "", "", "", "", "", ""])
        for path in ("unpatched", "patched"):
            p = (r.get("paths") or {}).get(path) or {}
            if "ops" not in p:
                rows.append([name, path, f"not run: {str(p.get('skipped') or '-')[:90]}", "", "", "", "", "", "", ""])
                continue
            for op, s in p["ops"].items():
                add(name, path + (" *" if p.get("bit_exact", {}).get("equal") else " !"), op, s)
        for path in ("unpatched", "patched"):
            p = (r.get("forward_only") or {}).get(path) or {}
            if "ops" not in p:
                continue
            for op, s in p["ops"].items():
                add(name, f"fwd-only {path}", op, s)
            rows.append([name, f"fwd-only {path}", "bytes copied per offload",
                         " ".join(f"{c / 1e9:.3f}" for c in p.get("offload_bytes_copied") or []), "", "", "", "", "",
                         ""])
    header = ["framework", "path", "op", "first s", "warm median s [min-max]", "GB", "GB/s", "of peak",
              "empty_cache ms", "of peak w/o it"]
    peak = result.get("link_peak_GBps")
    title = (f"link peak H2D {peak['h2d']:.1f} / D2H {peak['d2h']:.1f} GB/s" if peak else "no link peak (no GPU)")
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"SkyRL / AReaL offload functions ({title}); * bit-exact, ! not")
        for h in header:
            table.add_column(h)
        for row in rows:
            table.add_row(*row)
        console = Console()
        (console if console.is_terminal else Console(width=170)).print(table)
    except ImportError:
        print(title)
        for row in [header, *rows]:
            print(" | ".join(row))
    c = result["checks"]
    print(f"all patched at >= {TARGET_FRAC} of peak: {c['all_patched_at_target']} "
          f"(without empty_cache: {c['all_patched_at_target_excluding_release']}); forward-only copies nothing: "
          f"{c['forward_only_copies_nothing_after_first']}; all bit-exact: {c['all_bit_exact']}")
    for flag in result["flags"]:
        print(f"flag: {flag}")
