#!/usr/bin/env python3
"""Relay dtest's TCP rendezvous (port 15828) from LISTEN to SERVER, holding the server's
bytes for HOLD seconds before the client sees them.

Debian's dtest server sends its addresses over the rendezvous and only then creates the
service point it will accept on; its client connects as soon as it has read them. Against
a guest under TCG the client's connect can arrive first and is refused (RST,
DAT_CONNECTION_EVENT_NON_PEER_REJECTED), after which the server waits for ever. Holding
the server's message gives the server the time it needs; nothing of the RDMA traffic
passes here (the client takes the server's IA address from the message).

    dtest-relay.py LISTEN_ADDR SERVER_ADDR [HOLD]     (serves one rendezvous, then exits)
"""
import selectors
import socket
import sys
import time

PORT = 15828


def main():
    listen_addr, server_addr = sys.argv[1], sys.argv[2]
    hold = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    lsock = socket.create_server((listen_addr, PORT))
    print("relay listening", flush=True)
    client, _ = lsock.accept()
    lsock.close()
    server = socket.create_connection((server_addr, PORT), timeout=30)
    server.settimeout(None)
    sel = selectors.DefaultSelector()
    sel.register(client, selectors.EVENT_READ, server)
    sel.register(server, selectors.EVENT_READ, client)
    held = False
    open_ends = 2
    while open_ends:
        for key, _ in sel.select():
            data = key.fileobj.recv(65536)
            if key.fileobj is server and data and not held:
                time.sleep(hold)
                held = True
            if data:
                key.data.sendall(data)
            else:
                sel.unregister(key.fileobj)
                try:
                    key.data.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the other end is gone already
                open_ends -= 1
    client.close()
    server.close()


if __name__ == "__main__":
    main()
