"""A blocking MQTT v5 client for ACL tests: every call waits for the broker's answer.

MQTT v5 lets the broker say why it refused: a PUBACK or SUBACK carries a reason code
(0x87 "not authorized"), where MQTT 3.1.1 drops a refused publish silently.
"""

from __future__ import annotations

import ssl
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

SUCCESS = 0
NOT_AUTHORIZED = 0x87
BAD_USER_NAME_OR_PASSWORD = 0x86


class Probe:
    def __init__(
        self,
        port: int,
        user: str | None,
        password: str | None,
        *,
        ca: Path | None,
        client_id: str = "",
        will: tuple[str, bytes] | None = None,
    ) -> None:
        """``will``: the (topic, payload) of a last will the broker publishes when this
        client goes without a clean DISCONNECT (or with ``close_with_will``)."""
        self.port = port
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
        )
        if will is not None:
            self.client.will_set(will[0], will[1], qos=1)
        if ca is not None:
            self.client.tls_set(ca_certs=str(ca), tls_version=ssl.PROTOCOL_TLS_CLIENT)
        if user is not None:
            self.client.username_pw_set(user, password)
        self._cond = threading.Condition()
        self.connack: int | None = None
        self.disconnected = False
        self.messages: list[tuple[str, bytes]] = []
        self._pubacks: dict[int, int] = {}
        self._subacks: dict[int, list[int]] = {}
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe

    # --- callbacks (paho's network thread) -----------------------------------

    def _on_connect(
        self, client: Any, userdata: Any, flags: Any, rc: ReasonCode, properties: Properties | None
    ) -> None:
        with self._cond:
            self.connack = rc.value
            self._cond.notify_all()

    def _on_disconnect(
        self, client: Any, userdata: Any, flags: Any, rc: ReasonCode, properties: Properties | None
    ) -> None:
        with self._cond:
            self.disconnected = True
            if self.connack is None:
                self.connack = rc.value
            self._cond.notify_all()

    def _on_message(self, client: Any, userdata: Any, message: mqtt.MQTTMessage) -> None:
        with self._cond:
            self.messages.append((message.topic, bytes(message.payload)))
            self._cond.notify_all()

    def _on_publish(
        self, client: Any, userdata: Any, mid: int, rc: ReasonCode, properties: Properties | None
    ) -> None:
        with self._cond:
            self._pubacks[mid] = rc.value
            self._cond.notify_all()

    def _on_subscribe(
        self,
        client: Any,
        userdata: Any,
        mid: int,
        rcs: list[ReasonCode],
        properties: Properties | None,
    ) -> None:
        with self._cond:
            self._subacks[mid] = [rc.value for rc in rcs]
            self._cond.notify_all()

    # --- blocking calls --------------------------------------------------------

    def _wait(self, what: str, predicate: Any, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise TimeoutError(f"no {what} from the broker within {timeout}s")

    def connect(self, timeout: float = 10.0) -> int:
        """Connect; the CONNACK reason code (0: accepted)."""
        self.client.connect("127.0.0.1", self.port, keepalive=30)
        self.client.loop_start()
        self._wait("CONNACK", lambda: self.connack is not None, timeout)
        assert self.connack is not None
        return self.connack

    def subscribe(self, topic: str, timeout: float = 10.0) -> int:
        """Subscribe at QoS 1; the SUBACK reason code (1: granted QoS 1, 0x87: refused)."""
        result, mid = self.client.subscribe(topic, qos=1)
        assert result == mqtt.MQTT_ERR_SUCCESS, mqtt.error_string(result)
        self._wait(f"SUBACK for {topic}", lambda: mid in self._subacks, timeout)
        return self._subacks[mid][0]

    def publish(self, topic: str, payload: bytes = b"{}", timeout: float = 10.0) -> int:
        """Publish at QoS 1; the PUBACK reason code (0: accepted, 0x87: refused)."""
        info = self.client.publish(topic, payload, qos=1)
        self._wait(f"PUBACK for {topic}", lambda: info.mid in self._pubacks, timeout)
        return self._pubacks[info.mid]

    def received(self, topic: str) -> list[bytes]:
        with self._cond:
            return [p for t, p in self.messages if t == topic]

    def wait_message(self, topic: str, payload: bytes, timeout: float = 10.0) -> None:
        self._wait(
            f"message {payload!r} on {topic}", lambda: (topic, payload) in self.messages, timeout
        )

    def still_connected_after(self, seconds: float) -> bool:
        time.sleep(seconds)
        with self._cond:
            return not self.disconnected

    def close_with_will(self, timeout: float = 10.0) -> None:
        """End the session as a lost client does: the broker publishes the will (MQTT v5's
        DISCONNECT reason 0x04, "disconnect with will message")."""
        self.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, identifier=4))
        self._wait("the end of the connection", lambda: self.disconnected, timeout)
        self.client.loop_stop()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
