"""The CUDA weights holder with the real daemons on a GPU: two workers map one
copy of the weights, a copying and a host-mapped worker give the same tokens,
a killed worker is back in under a second, the workers keep the weights when
the holder dies, and the next worker then copies.
Skips (77) without a GPU or without the CUDA build."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "lib"))
from ds4test import BIN, STORIES, ONCE, Daemon, check, finish, request, skip, tokens_of  # noqa: E402


def gpu_used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return int(out.split()[0])


def settle():
    time.sleep(1.0)  # nvidia-smi's reading lags the allocation a little
    return gpu_used_mib()


def wait_holder(path, proc, timeout=120):
    """Until the holder answers on `path` (a dead holder's socket file may still be there)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(path)
            answered = s.recv(65536).startswith(b"{")
            s.close()
            if answered:
                return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def greedy(sock):
    return tokens_of(request(sock, {"op": "generate", "prompt": ONCE, "max_tokens": 16, "temperature": 0}))


def main():
    if shutil.which("nvidia-smi") is None:
        skip("no nvidia-smi: no GPU here")
    work = tempfile.mkdtemp(prefix="ds4-holder-test-")
    model = os.path.join(work, "1b.gguf")
    mk = subprocess.run([os.path.join(BIN, "ds4-mkmodel"), "--out", model, "--vocab-from", STORIES, "--preset", "1b",
                         "--type", "f16"], capture_output=True, text=True, timeout=600)
    if mk.returncode != 0:
        raise RuntimeError("ds4-mkmodel failed: " + mk.stderr)
    seg = subprocess.run([os.path.join(BIN, "ds4-worker"), "load", "--model", model], capture_output=True, text=True,
                         timeout=600).stdout.strip().splitlines()[-1]
    weights_mib = os.path.getsize(model) / 2**20
    hsock = os.path.join(work, "holder.sock")
    hlog = open(os.path.join(work, "holder.log"), "w+")

    def start_holder():
        p = subprocess.Popen([os.path.join(BIN, "ds4-worker"), "hold", "--segment", seg, "--device", "cuda:0",
                              "--socket", hsock], stdout=hlog, stderr=subprocess.STDOUT)
        if not wait_holder(hsock, p):
            hlog.seek(0)
            out = hlog.read()
            if "no CUDA device" in out or "without the CUDA backend" in out or "driver" in out:
                skip("no usable GPU: " + out.strip().splitlines()[-1])
            raise RuntimeError("holder did not start: " + out)
        return p

    daemons = []
    holder = None
    try:
        base = settle()
        holder = start_holder()
        with_holder = settle()
        check(with_holder - base >= 0.9 * weights_mib,
              f"the holder keeps the weights on the GPU (+{with_holder - base} MiB for {weights_mib:.0f} MiB)")

        extra = ("--device", "cuda:0", "--gpu-weights", "holder", "--holder-socket", hsock)
        w1 = Daemon(seg, context=1024, slots=1, extra=extra)
        daemons.append(w1)
        used1 = settle()
        w2 = Daemon(seg, context=1024, slots=1, extra=extra)
        daemons.append(w2)
        used2 = settle()
        check("weights: holder" in w1.info()["backend"] and "weights: holder" in w2.info()["backend"],
              "both workers map the holder's weights")
        check(used1 - with_holder < weights_mib / 2 and used2 - used1 < weights_mib / 2,
              f"each worker adds only its own KV cache and scratch (+{used1 - with_holder}, +{used2 - used1} MiB; "
              f"weights {weights_mib:.0f} MiB)")
        want = greedy(w1.sock)
        check(len(want) == 16 and greedy(w2.sock) == want, "both workers give the same greedy tokens")

        w3 = Daemon(seg, context=1024, slots=1, extra=("--device", "cuda:0", "--gpu-weights", "copy"))
        daemons.append(w3)
        used3 = settle()
        check(used3 - used2 >= 0.9 * weights_mib, f"a copying worker adds the weights (+{used3 - used2} MiB)")
        check(greedy(w3.sock) == want, "the copying worker gives the same tokens")
        w3.stop()
        before = settle()
        w6 = Daemon(seg, context=1024, slots=1, extra=("--device", "cuda:0", "--gpu-weights", "host-mapped"))
        daemons.append(w6)
        used6 = settle()
        check("weights: host-mapped" in w6.info()["backend"] and used6 - before < weights_mib / 2,
              f"a host-mapped worker reads the shared pages in place (+{used6 - before} MiB on the device)")
        check(greedy(w6.sock) == want, "the host-mapped worker gives the same tokens")
        w6.stop()

        # SIGKILL a worker and start it again, as the supervisor does.
        w1.stop(signal.SIGKILL)
        t0 = time.time()
        w1 = Daemon(seg, context=1024, slots=1, extra=extra)
        daemons.append(w1)
        back = time.time() - t0
        check(back < 1.0, f"a killed worker answers again in under a second with the holder ({back:.3f} s)")
        check(greedy(w1.sock) == want, "the restarted worker gives the same tokens")

        # The holder dies: mapped workers keep their weights; the next worker copies.
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        check(greedy(w2.sock) == want, "a worker keeps the weights after the holder was killed")
        w4 = Daemon(seg, context=1024, slots=1, extra=extra)
        daemons.append(w4)
        check("weights: copy" in w4.info()["backend"] and "no weights from the holder" in w4.output(),
              "without a holder the next worker copies the weights and says why")
        check(greedy(w4.sock) == want, "the copying fallback gives the same tokens")
        w4.stop()

        # A holder started again serves the next workers.
        holder = start_holder()
        w5 = Daemon(seg, context=1024, slots=1, extra=extra)
        daemons.append(w5)
        check("weights: holder" in w5.info()["backend"], "a restarted holder serves the next worker")
    finally:
        for d in daemons:
            d.stop()
        if holder and holder.poll() is None:
            holder.terminate()
            holder.wait(timeout=20)
        subprocess.run([os.path.join(BIN, "ds4-worker"), "unload", "--segment", seg], capture_output=True, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()
