"""Test helper: a TCP echo server. Prints {"event": "peer", "peer": [host, port]} per
connection; echoes every byte; half-closes its side when the client does."""

import json
import socket
import sys
import threading


def handle(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1 << 20):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)
    while True:
        conn, peer = srv.accept()
        print(json.dumps({"event": "peer", "peer": list(peer)}), flush=True)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
