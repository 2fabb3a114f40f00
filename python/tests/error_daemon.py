"""A stand-in for tuttid that answers the first request of each connection with an Error frame
and closes it: for tests of how the client classifies a daemon's refusals."""

from __future__ import annotations

import socket
import struct
import threading
import time

ERROR_KIND = 0x80FF
PROTOCOL_VERSION = 9


class ErrorDaemon:
    """Listens at `path`; to each connection's first request, after `delay_s`, answers an Error
    of `code` (tutti-daemon's ErrorCode number) with `message`, under request id 0 when
    `goodbye` (the daemon ending the connection) or the request's own id otherwise, then closes
    it. A client that gave up before the answer is what the tests expect: its broken pipe is
    ignored."""

    def __init__(self, path, code: int, message: bytes, delay_s: float = 0.0, goodbye: bool = False):
        self.code, self.message, self.delay_s, self.goodbye = code, message, delay_s, goodbye
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.listener.settimeout(0.05)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while not self.stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except socket.timeout:
                continue
            with connection:
                connection.settimeout(5.0)
                header = connection.recv(16, socket.MSG_WAITALL)
                if len(header) < 16:
                    continue
                _, _, _, request_id, body_bytes = struct.unpack("<4sHHII", header)
                if body_bytes:
                    connection.recv(body_bytes, socket.MSG_WAITALL)
                time.sleep(self.delay_s)
                body = struct.pack("<HH", self.code, len(self.message)) + self.message
                answered = 0 if self.goodbye else request_id
                try:
                    connection.sendall(struct.pack("<4sHHII", b"TUTD", PROTOCOL_VERSION, ERROR_KIND, answered, len(body)) + body)
                except OSError:
                    continue

    def stop(self):
        self.stopping.set()
        self.thread.join(5.0)
        self.listener.close()
