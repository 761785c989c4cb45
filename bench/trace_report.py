#!/usr/bin/env python3
"""Where each request's time went, from DS4_TRACE records (shared/request_trace.h).

    bench/trace_report.py PREFIX [CLIENT_FILE] [--check N]

PREFIX.proxy and PREFIX.worker-ID-PID are the records; CLIENT_FILE is
bench/http_load.c's output with HTTP_LOAD_TRACE=1 (the client's send and end
and its port: the proxy's records carry the client's port, so the requests of
a connection pair up in order). Prints, per stage, the mean, p50 and p90 in us.
A request that a worker answered after a restart of it (its ids start again)
is left out. --check N: exit 1 unless N requests have every stage and their
times run forward (CI's test_request_trace)."""
import glob
import statistics
import struct
import sys

HEADER, RECORD = 64, struct.Struct("<qqii")
RECEIVED, DISPATCH, LINE, HANDLED, WREAD, WSTEP = 1, 2, 4, 5, 6, 7  # shared/request_trace.h's Stage


def load(path):
    data = open(path, "rb").read()
    n = min(struct.unpack_from("<Q", data, 0)[0], (len(data) - HEADER) // RECORD.size)
    return [RECORD.unpack_from(data, HEADER + RECORD.size * i) for i in range(n)]


def main(argv):
    check = None
    if "--check" in argv:
        i = argv.index("--check")
        check = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if len(argv) not in (2, 3):
        sys.exit(__doc__)
    prefix = argv[1]
    proxy = {}  # id -> {stage: [(ns, extra)]}
    for ns, rid, stage, extra in load(prefix + ".proxy"):
        proxy.setdefault(rid, {}).setdefault(stage, []).append((ns, extra))
    workers = {}  # worker id -> {id: {stage: [(ns, extra)]}}, or None after a restart
    for path in sorted(glob.glob(prefix + ".worker-*")):
        wid = int(path[len(prefix) + len(".worker-"):].split("-")[0])
        if wid in workers:
            workers[wid] = None  # two processes for one worker: its ids repeat
            continue
        recs = {}
        for ns, rid, stage, extra in load(path):
            recs.setdefault(rid, {}).setdefault(stage, []).append((ns, extra))
        workers[wid] = recs
    rows = {}  # id -> stage -> ns (the last of each; the answer's last line)
    for rid, st in proxy.items():
        if not all(s in st for s in (RECEIVED, DISPATCH, LINE, HANDLED)) or len(st[DISPATCH]) != 1:
            continue
        w = workers.get(st[DISPATCH][0][1])
        if not w or rid not in w or not all(s in w[rid] for s in (WREAD, WSTEP)):
            continue
        row = {s: v[-1][0] for s, v in st.items()}
        row.update({s: v[-1][0] for s, v in w[rid].items()})
        row["port"] = st[RECEIVED][0][1]
        row["ended_in_step"] = w[rid][WSTEP][-1][1]
        row["place"] = st[LINE][-1][1]
        rows[rid] = row
    if len(argv) == 3:  # the client's send and end, by port in order
        by_port = {}
        for line in open(argv[2]):
            f = line.split()
            if len(f) >= 6:
                by_port.setdefault(int(float(f[5])), []).append((float(f[3]), float(f[4])))
        ours = {}
        for rid, r in rows.items():
            ours.setdefault(r["port"], []).append(rid)
        for port, sends in by_port.items():
            ids = sorted(ours.get(port, []), key=lambda i: rows[i][RECEIVED])
            if len(ids) != len(sends):
                continue  # a request of that connection was not traced whole: the pairing would slip
            for (t0, t1), rid in zip(sorted(sends), ids):
                rows[rid]["client_send"], rows[rid]["client_end"] = t0, t1
        rows = {i: r for i, r in rows.items() if "client_send" in r}
    stages = [("client sends -> the proxy has it all", "client_send", RECEIVED),
              ("proxy: route, queue, dispatch", RECEIVED, DISPATCH),
              ("dispatch -> the worker reads it", DISPATCH, WREAD),
              ("worker: read -> its step ends", WREAD, WSTEP),
              ("step end -> the proxy reads the line", WSTEP, LINE),
              ("proxy: line -> answer handled", LINE, HANDLED),
              ("answer handled -> the client has it", HANDLED, "client_end"),
              ("whole, as the client saw it", "client_send", "client_end")]
    print(f"{len(rows)} requests traced whole")
    backwards = 0
    for name, a, b in stages:
        xs = sorted((r[b] - r[a]) / 1e3 for r in rows.values() if a in r and b in r)
        if not xs:
            continue
        print(f"  {name:38s} mean {statistics.mean(xs):9.1f} us   p50 {xs[len(xs) // 2]:9.1f}   "
              f"p90 {xs[int(len(xs) * 0.9)]:9.1f}")
    for r in rows.values():
        order = [r.get("client_send", r[RECEIVED]), r[RECEIVED], r[DISPATCH], r[WREAD], r[WSTEP], r[LINE],
                 r.get("client_end", r[LINE])]
        backwards += any(x > y for x, y in zip(order, order[1:]))
    if rows:
        print(f"  requests ended in their step: mean {statistics.mean(r['ended_in_step'] for r in rows.values()):.1f}; "
              f"place of the answer's line in the proxy's read: mean {statistics.mean(r['place'] for r in rows.values()):.1f}")
    if check is not None:
        if len(rows) != check or backwards:
            print(f"check failed: {len(rows)} requests traced whole (want {check}), {backwards} with times out of order")
            return 1
        print("check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
