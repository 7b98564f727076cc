"""bench/gpu_serve_watch.py: the /metrics reads taken during a GPU serving run, parsed and summed
up, and the loop against a real HTTP server that stops answering for a while."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

from bench.gpu_serve_watch import sample_of, summarize, unanswered, watch

METRICS = """# HELP pdserve_requests_in_flight Requests being served now.
# TYPE pdserve_requests_in_flight gauge
pdserve_requests_in_flight 51.0
pdserve_generation_tokens_total 69478.0
pdserve_worker_requests{role="decode",state="running",worker="decode-0"} 3.0
pdserve_worker_requests{role="decode",state="waiting",worker="decode-0"} 9.0
pdserve_worker_requests{role="decode",state="pinned",worker="decode-0"} 0.0
pdserve_worker_requests{role="decode",state="running",worker="decode-1"} 4.0
pdserve_worker_requests{role="decode",state="waiting",worker="decode-1"} 0.0
pdserve_time_to_first_token_seconds_count 388.0
"""


def test_a_read_gives_the_routers_in_flight_and_each_workers_queue():
    s = sample_of(METRICS, 1.23456)
    assert s == {
        "t": 1.235, "answered": True, "in_flight": 51.0, "tokens": 69478.0,
        "workers": {"decode-0": {"running": 3.0, "waiting": 9.0}, "decode-1": {"running": 4.0, "waiting": 0.0}},
    }  # fmt: skip


def test_the_summary_finds_the_longest_silence_and_the_largest_queues():
    quiet = sample_of(METRICS.replace("51.0", "2.0").replace(" 9.0", " 1.0"), 0.0)
    samples = [quiet, unanswered(0.25, "timeout"), unanswered(0.5, "timeout"), unanswered(1.0, "timeout"),
               sample_of(METRICS, 1.25), unanswered(1.5, "timeout")]  # fmt: skip
    assert summarize(samples) == {
        "reads": 6, "unanswered": 4, "longest_unanswered_s": 0.75, "max_in_flight": 51.0,
        "max_worker_running": 4.0, "max_worker_waiting": 9.0,
    }  # fmt: skip
    assert summarize([])["max_in_flight"] is None


def test_the_loop_records_the_reads_a_stalled_server_does_not_answer():
    stalled = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if stalled.is_set():
                time.sleep(0.6)
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"

    async def go() -> list[dict]:
        stop = asyncio.Event()
        task = asyncio.create_task(watch(url, stop, interval_s=0.05, timeout_s=0.2))
        await asyncio.sleep(0.3)
        stalled.set()
        await asyncio.sleep(0.8)
        stalled.clear()
        await asyncio.sleep(0.8)  # a stalled handler still sleeping ends before the next ones answer
        stop.set()
        return await asyncio.wait_for(task, 5.0)

    try:
        samples = asyncio.run(go())
    finally:
        server.shutdown()
    answered = [s["answered"] for s in samples]
    assert answered[0] and answered[-1], answered
    assert False in answered, "the stalled reads must show as unanswered"
    assert summarize(samples)["longest_unanswered_s"] > 0.1
    assert all(s["in_flight"] == 51.0 for s in samples if s["answered"])
