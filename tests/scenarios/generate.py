#!/usr/bin/env python3
"""Writes kube-proxy-parity.json: the project's packet-scenario corpus.

Every expectation below is written out by hand from kube-proxy's documented behaviour
(Service docs: virtual IPs and service proxies, traffic policies, topology-aware routing,
session affinity; kube-proxy's iptables/nftables packet-flow tests). Helpers only remove
boilerplate; they never compute an expectation. Run it after editing; commit both files.
"""
import json
import os

NODE = {
    "nodeName": "node-a",
    "nodeIPs": ["192.0.2.10", "2001:db8:a::10"],
    "labels": {"topology.kubernetes.io/zone": "zone-a"},
    "clusterCIDRs": ["10.244.0.0/16", "fd00:244::/48"],
    "localDetector": "ClusterCIDR",
    "masqueradeAll": False,
    "nodePortAddresses": [],
    "localhostNodePorts": True,
}

POD = "10.244.0.3"          # a pod on node-a
POD6 = "fd00:244::3"
OUTSIDE = "198.51.100.7"    # a client outside the cluster
OUTSIDE6 = "2001:db8:ff::7"
NODE_IP = "192.0.2.10"
NODE_IP6 = "2001:db8:a::10"


def svc(name, spec, status=None, labels=None):
    o = {"apiVersion": "v1", "kind": "Service",
         "metadata": {"namespace": "default", "name": name}, "spec": spec}
    if labels:
        o["metadata"]["labels"] = labels
    if status:
        o["status"] = status
    return o


def port(p=80, target=8080, name="http", proto="TCP", node_port=None):
    d = {"name": name, "protocol": proto, "port": p, "targetPort": target}
    if node_port:
        d["nodePort"] = node_port
    return d


def ep(addr, node="node-b", ready=True, serving=True, terminating=False, zones=None, nodes=None):
    e = {"addresses": [addr], "nodeName": node,
         "conditions": {"ready": ready, "serving": serving, "terminating": terminating}}
    if zones is not None or nodes is not None:
        e["hints"] = {}
        if zones is not None:
            e["hints"]["forZones"] = [{"name": z} for z in zones]
        if nodes is not None:
            e["hints"]["forNodes"] = [{"name": n} for n in nodes]
    return e


def eps(service, endpoints, family="IPv4", ports=None, name=None):
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "default", "name": name or f"{service}-{family.lower()}",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": family,
            "ports": ports or [{"name": "http", "protocol": "TCP", "port": 8080}],
            "endpoints": endpoints}


def pkt(name, src, dst, dport, verdict, endpoints=(), masq=False, proto="TCP"):
    return {"name": name, "proto": proto, "src_ip": src, "dst_ip": dst, "dst_port": dport,
            "expect": {"verdict": verdict, "endpoints": list(endpoints), "masquerade": masq}}


def case(id, services, slices, packets, node=None):
    c = {"id": id, "objects": {"services": services, "endpointslices": slices}, "packets": packets}
    if node:
        c["node"] = node
    return c


WEB = ["10.244.1.5:8080", "10.244.2.6:8080"]
web_slice = eps("web", [ep("10.244.1.5"), ep("10.244.2.6", node="node-c")])
web = svc("web", {"type": "ClusterIP", "clusterIP": "10.96.0.10", "ports": [port()]})

cases = []

# --- ClusterIP -------------------------------------------------------------------------
cases.append(case("clusterip-sources", [web], [web_slice], [
    pkt("pod to ClusterIP", POD, "10.96.0.10", 80, "dnat", WEB),
    pkt("another pod to ClusterIP", "10.244.3.9", "10.96.0.10", 80, "dnat", WEB),
    pkt("client outside the pod network is masqueraded", OUTSIDE, "10.96.0.10", 80, "dnat", WEB, True),
    pkt("the node itself is masqueraded (not from the pod network)", NODE_IP, "10.96.0.10", 80, "dnat", WEB, True),
    pkt("a port the Service does not have is not ours", POD, "10.96.0.10", 81, "accept"),
    pkt("UDP to a TCP-only Service is not ours", POD, "10.96.0.10", 80, "accept", proto="UDP"),
    pkt("another address in the service range is not ours", POD, "10.96.0.11", 80, "accept"),
]))

multi = svc("multi", {"clusterIP": "10.96.0.12", "ports": [
    port(80, 8080, "http"), port(443, "https", "https"), port(53, 5353, "dns", "UDP"), port(53, 5354, "dns-tcp", "TCP")]})
multi_slice = eps("multi", [ep("10.244.1.7"), ep("10.244.2.8", node="node-c")], ports=[
    {"name": "http", "protocol": "TCP", "port": 8080},
    {"name": "https", "protocol": "TCP", "port": 8443},
    {"name": "dns", "protocol": "UDP", "port": 5353},
    {"name": "dns-tcp", "protocol": "TCP", "port": 5354}])
cases.append(case("multi-port-and-named-target-ports", [multi], [multi_slice], [
    pkt("port 80 to targetPort 8080", POD, "10.96.0.12", 80, "dnat", ["10.244.1.7:8080", "10.244.2.8:8080"]),
    pkt("port 443 to the named targetPort https (8443 in the slice)", POD, "10.96.0.12", 443, "dnat", ["10.244.1.7:8443", "10.244.2.8:8443"]),
    pkt("UDP 53 to its own port", POD, "10.96.0.12", 53, "dnat", ["10.244.1.7:5353", "10.244.2.8:5353"], proto="UDP"),
    pkt("TCP 53 to its own port (name and protocol both match)", POD, "10.96.0.12", 53, "dnat", ["10.244.1.7:5354", "10.244.2.8:5354"]),
]))

cases.append(case("slices-merge-and-deduplicate", [web], [
    eps("web", [ep("10.244.1.5"), ep("10.244.2.6", node="node-c")], name="web-1"),
    eps("web", [ep("10.244.2.6", node="node-c"), ep("10.244.3.7", node="node-d")], name="web-2"),
    eps("other", [ep("10.244.9.9")], name="other-1"),
], [
    pkt("endpoints of every slice of the Service, once each", POD, "10.96.0.10", 80, "dnat",
        ["10.244.1.5:8080", "10.244.2.6:8080", "10.244.3.7:8080"]),
]))

cases.append(case("endpoint-conditions", [web], [eps("web", [
    ep("10.244.1.5"), ep("10.244.2.6", ready=False, serving=False), ep("10.244.3.7", ready=False, serving=True, terminating=True)])], [
    pkt("only ready endpoints while any is ready", POD, "10.96.0.10", 80, "dnat", ["10.244.1.5:8080"]),
]))

cases.append(case("terminating-fallback-serving-only", [web], [eps("web", [
    ep("10.244.1.5", ready=False, serving=True, terminating=True),
    ep("10.244.2.6", ready=False, serving=True, terminating=True, node="node-c"),
    ep("10.244.3.7", ready=False, serving=False, terminating=True)])], [
    pkt("no ready endpoint: serving+terminating ones are used", POD, "10.96.0.10", 80, "dnat", ["10.244.1.5:8080", "10.244.2.6:8080"]),
    pkt("from outside too, masqueraded", OUTSIDE, "10.96.0.10", 80, "dnat", ["10.244.1.5:8080", "10.244.2.6:8080"], True),
]))

cases.append(case("no-usable-endpoints-rejects", [
    web, svc("dns", {"clusterIP": "10.96.0.13", "ports": [port(53, 53, "dns", "UDP")]})], [
    eps("web", [ep("10.244.2.6", ready=False, serving=False, terminating=True)])], [
    pkt("TCP to a Service whose only endpoint is not serving: rejected", POD, "10.96.0.10", 80, "reject"),
    pkt("from outside: rejected", OUTSIDE, "10.96.0.10", 80, "reject"),
    pkt("UDP to a Service without endpoints: rejected (ICMP port unreachable)", POD, "10.96.0.13", 53, "reject", proto="UDP"),
]))

cases.append(case("hairpin", [web], [eps("web", [ep(POD, node="node-a")])], [
    pkt("a pod reaching itself through its Service is masqueraded", POD, "10.96.0.10", 80, "dnat", [f"{POD}:8080"], True),
    pkt("another pod is not", "10.244.0.4", "10.96.0.10", 80, "dnat", [f"{POD}:8080"], False),
]))

cases.append(case("masquerade-all", [web], [web_slice], [
    pkt("masqueradeAll: pod traffic is masqueraded too", POD, "10.96.0.10", 80, "dnat", WEB, True),
    pkt("masqueradeAll: and outside traffic", OUTSIDE, "10.96.0.10", 80, "dnat", WEB, True),
], node={"masqueradeAll": True}))

cases.append(case("no-local-detector", [web], [web_slice], [
    pkt("pod traffic cannot be told apart: not masqueraded", POD, "10.96.0.10", 80, "dnat", WEB, False),
    pkt("nor outside traffic (kube-proxy cannot tell)", OUTSIDE, "10.96.0.10", 80, "dnat", WEB, False),
], node={"localDetector": "None"}))

cases.append(case("not-proxied", [
    svc("headless", {"clusterIP": "None", "ports": [port()]}),
    svc("ext", {"type": "ExternalName", "externalName": "example.org", "clusterIP": "", "ports": [port()]}),
    svc("theirs", {"clusterIP": "10.96.0.14", "ports": [port()]}, labels={"service.kubernetes.io/service-proxy-name": "other-proxy"}),
], [eps("headless", [ep("10.244.1.5")]), eps("theirs", [ep("10.244.1.6")])], [
    pkt("a Service labelled for another proxy is not ours", POD, "10.96.0.14", 80, "accept"),
    pkt("a pod IP is not a service", POD, "10.244.1.5", 8080, "accept"),
]))

# --- internalTrafficPolicy ---------------------------------------------------------------
itp = svc("web", {"clusterIP": "10.96.0.10", "internalTrafficPolicy": "Local", "ports": [port()]})
cases.append(case("internal-policy-local", [itp], [eps("web", [ep("10.244.0.5", node="node-a"), ep("10.244.2.6", node="node-c")])], [
    pkt("only the endpoint on this node", POD, "10.96.0.10", 80, "dnat", ["10.244.0.5:8080"]),
    pkt("from outside the pod network too, masqueraded", OUTSIDE, "10.96.0.10", 80, "dnat", ["10.244.0.5:8080"], True),
]))
cases.append(case("internal-policy-local-remote-only", [itp], [eps("web", [ep("10.244.2.6", node="node-c")])], [
    pkt("endpoints exist elsewhere but not here: dropped", POD, "10.96.0.10", 80, "drop"),
]))
cases.append(case("internal-policy-local-none-at-all", [itp], [], [
    pkt("no endpoint anywhere: rejected", POD, "10.96.0.10", 80, "reject"),
]))
cases.append(case("internal-policy-local-terminating-fallback", [itp], [eps("web", [
    ep("10.244.0.5", node="node-a", ready=False, serving=True, terminating=True), ep("10.244.2.6", node="node-c")])], [
    pkt("the local endpoint is only serving+terminating: used", POD, "10.96.0.10", 80, "dnat", ["10.244.0.5:8080"]),
]))

# --- NodePort --------------------------------------------------------------------------
SHOP = ["10.244.0.8:8080", "10.244.2.9:8080"]
shop_slice = eps("shop", [ep("10.244.0.8", node="node-a"), ep("10.244.2.9", node="node-c")])
shop6_slice = eps("shop", [ep("fd00:244::8", node="node-a"), ep("fd00:244:2::9", node="node-c")], family="IPv6")
SHOP6 = ["[fd00:244::8]:8080", "[fd00:244:2::9]:8080"]


def shop(etp="Cluster", families=("IPv4",), udp=False):
    ips = {"IPv4": "10.96.0.20", "IPv6": "fd00:96::20"}
    ports = [port(80, 8080, "http", node_port=30080)]
    if udp:
        ports.append(port(53, 5353, "dns", "UDP", node_port=30053))
    return svc("shop", {"type": "NodePort", "clusterIP": ips[families[0]], "clusterIPs": [ips[f] for f in families],
                        "ipFamilies": list(families), "externalTrafficPolicy": etp, "ports": ports})


cases.append(case("nodeport-cluster-policy", [shop()], [shop_slice], [
    pkt("external client to NodePort: every endpoint, masqueraded", OUTSIDE, NODE_IP, 30080, "dnat", SHOP, True),
    pkt("pod to NodePort: masqueraded (eTP Cluster)", POD, NODE_IP, 30080, "dnat", SHOP, True),
    pkt("the node to its own NodePort", NODE_IP, NODE_IP, 30080, "dnat", SHOP, True),
    pkt("localhost NodePort from the node", "127.0.0.1", "127.0.0.1", 30080, "dnat", SHOP, True),
    pkt("its ClusterIP from a pod is not masqueraded", POD, "10.96.0.20", 80, "dnat", SHOP, False),
    pkt("another port on the node address is the node's own", OUTSIDE, NODE_IP, 30081, "local"),
]))
cases.append(case("nodeport-no-localhost", [shop()], [shop_slice], [
    pkt("localhostNodePorts false: 127.0.0.1:<nodePort> is the node's own", "127.0.0.1", "127.0.0.1", 30080, "local"),
    pkt("the node address still works", OUTSIDE, NODE_IP, 30080, "dnat", SHOP, True),
], node={"localhostNodePorts": False}))
cases.append(case("nodeport-addresses-restricted", [shop()], [shop_slice], [
    pkt("a node address outside nodePortAddresses serves no NodePort", OUTSIDE, NODE_IP, 30080, "local"),
    pkt("one inside does", OUTSIDE, "192.0.2.11", 30080, "dnat", SHOP, True),
], node={"nodeIPs": ["192.0.2.10", "192.0.2.11"], "nodePortAddresses": ["192.0.2.11/32"]}))
cases.append(case("nodeport-udp", [shop(udp=True)], [eps("shop", [ep("10.244.0.8", node="node-a"), ep("10.244.2.9", node="node-c")],
    ports=[{"name": "http", "protocol": "TCP", "port": 8080}, {"name": "dns", "protocol": "UDP", "port": 5353}])], [
    pkt("UDP NodePort from outside", OUTSIDE, NODE_IP, 30053, "dnat", ["10.244.0.8:5353", "10.244.2.9:5353"], True, proto="UDP"),
    pkt("TCP on the UDP NodePort number is the node's own", OUTSIDE, NODE_IP, 30053, "local"),
]))
cases.append(case("nodeport-local-policy", [shop("Local")], [shop_slice], [
    pkt("external client: only the local endpoint, source kept", OUTSIDE, NODE_IP, 30080, "dnat", ["10.244.0.8:8080"], False),
    pkt("a pod short-circuits to every endpoint, not masqueraded", POD, NODE_IP, 30080, "dnat", SHOP, False),
    pkt("the node itself short-circuits to every endpoint, masqueraded", NODE_IP, NODE_IP, 30080, "dnat", SHOP, True),
    pkt("the ClusterIP is not affected by eTP", POD, "10.96.0.20", 80, "dnat", SHOP, False),
]))
cases.append(case("nodeport-local-policy-no-local-endpoint", [shop("Local")], [shop_slice], [
    pkt("external client on a node without a local endpoint: dropped", OUTSIDE, NODE_IP, 30080, "drop"),
    pkt("a pod there still reaches every endpoint", "10.244.5.3", NODE_IP, 30080, "dnat", SHOP, False),
], node={"nodeName": "node-b"}))
cases.append(case("nodeport-local-policy-terminating", [shop("Local")], [eps("shop", [
    ep("10.244.0.8", node="node-a", ready=False, serving=True, terminating=True), ep("10.244.2.9", node="node-c")])], [
    pkt("the local endpoint is terminating but serving: used for external traffic", OUTSIDE, NODE_IP, 30080, "dnat", ["10.244.0.8:8080"], False),
    pkt("pods use the ready cluster endpoint", POD, NODE_IP, 30080, "dnat", ["10.244.2.9:8080"], False),
]))
cases.append(case("nodeport-ipv6", [shop(families=("IPv6",))], [shop6_slice], [
    pkt("IPv6 NodePort from outside", OUTSIDE6, NODE_IP6, 30080, "dnat", SHOP6, True),
    pkt("IPv6 ClusterIP from a pod", POD6, "fd00:96::20", 80, "dnat", SHOP6, False),
    pkt("no IPv4 NodePort for an IPv6-only Service", OUTSIDE, NODE_IP, 30080, "local"),
]))
cases.append(case("nodeport-dual-stack", [shop(families=("IPv4", "IPv6"))], [shop_slice, shop6_slice], [
    pkt("IPv4 NodePort to IPv4 endpoints", OUTSIDE, NODE_IP, 30080, "dnat", SHOP, True),
    pkt("IPv6 NodePort to IPv6 endpoints", OUTSIDE6, NODE_IP6, 30080, "dnat", SHOP6, True),
    pkt("IPv4 ClusterIP", POD, "10.96.0.20", 80, "dnat", SHOP),
    pkt("IPv6 ClusterIP", POD6, "fd00:96::20", 80, "dnat", SHOP6),
]))

# --- external IPs and load balancers ----------------------------------------------------------
def edge(etp="Cluster", ranges=None, ingress=None, external_ips=None, lb=True):
    spec = {"type": "LoadBalancer" if lb else "ClusterIP", "clusterIP": "10.96.0.30", "externalTrafficPolicy": etp,
            "ports": [port(80, 8080, "http", node_port=30090 if lb else None)]}
    if ranges:
        spec["loadBalancerSourceRanges"] = ranges
    if external_ips:
        spec["externalIPs"] = external_ips
    status = {"loadBalancer": {"ingress": ingress if ingress is not None else [{"ip": "203.0.113.50"}]}} if lb else None
    if not lb:
        spec.pop("externalTrafficPolicy")
    return svc("edge", spec, status)


EDGE = ["10.244.0.9:8080", "10.244.3.10:8080"]
edge_slice = eps("edge", [ep("10.244.0.9", node="node-a"), ep("10.244.3.10", node="node-d")])
cases.append(case("external-ips", [edge(lb=False, external_ips=["203.0.113.7"])], [edge_slice], [
    pkt("external IP from outside: every endpoint, masqueraded", OUTSIDE, "203.0.113.7", 80, "dnat", EDGE, True),
    pkt("external IP from a pod: masqueraded (eTP Cluster)", POD, "203.0.113.7", 80, "dnat", EDGE, True),
    pkt("another port of the external IP is not ours", OUTSIDE, "203.0.113.7", 81, "accept"),
]))
cases.append(case("external-ips-local-policy", [svc("edge", {"clusterIP": "10.96.0.30", "externalIPs": ["203.0.113.7"],
    "externalTrafficPolicy": "Local", "ports": [port()]})], [edge_slice], [
    pkt("external IP, eTP Local: only the local endpoint, source kept", OUTSIDE, "203.0.113.7", 80, "dnat", ["10.244.0.9:8080"], False),
    pkt("a pod short-circuits to every endpoint", POD, "203.0.113.7", 80, "dnat", EDGE, False),
]))
cases.append(case("load-balancer", [edge(ingress=[{"ip": "203.0.113.50"}, {"ip": "203.0.113.51", "ipMode": "Proxy"}, {"hostname": "lb.example"}])], [edge_slice], [
    pkt("load-balancer IP from outside", OUTSIDE, "203.0.113.50", 80, "dnat", EDGE, True),
    pkt("load-balancer IP from a pod", POD, "203.0.113.50", 80, "dnat", EDGE, True),
    pkt("ipMode Proxy: the load balancer proxies, the IP is not ours", OUTSIDE, "203.0.113.51", 80, "accept"),
    pkt("and its NodePort", OUTSIDE, NODE_IP, 30090, "dnat", EDGE, True),
]))
cases.append(case("load-balancer-source-ranges", [edge(ranges=["198.51.100.0/28", "192.0.2.128/25"])], [edge_slice], [
    pkt("client in the first range", "198.51.100.7", "203.0.113.50", 80, "dnat", EDGE, True),
    pkt("client in the second range", "192.0.2.200", "203.0.113.50", 80, "dnat", EDGE, True),
    pkt("client outside the ranges: dropped", "198.51.100.200", "203.0.113.50", 80, "drop"),
    pkt("the ranges guard the LB IP only, not the NodePort", "198.51.100.200", NODE_IP, 30090, "dnat", EDGE, True),
    pkt("nor the ClusterIP", POD, "10.96.0.30", 80, "dnat", EDGE, False),
]))
cases.append(case("load-balancer-local-policy-with-ranges", [edge("Local", ranges=["198.51.100.0/24"])], [edge_slice], [
    pkt("allowed client, eTP Local: local endpoint, source kept", OUTSIDE, "203.0.113.50", 80, "dnat", ["10.244.0.9:8080"], False),
    pkt("client outside the ranges: dropped", "203.0.113.99", "203.0.113.50", 80, "drop"),
]))
cases.append(case("load-balancer-local-policy-elsewhere", [edge("Local")], [edge_slice], [
    pkt("no local endpoint on this node: external traffic dropped", OUTSIDE, "203.0.113.50", 80, "drop"),
    pkt("its NodePort too", OUTSIDE, "192.0.2.12", 30090, "drop"),
], node={"nodeName": "node-b", "nodeIPs": ["192.0.2.12"]}))

# --- topology ------------------------------------------------------------------------------
topo = svc("web", {"clusterIP": "10.96.0.10", "trafficDistribution": "PreferClose", "ports": [port()]})
cases.append(case("topology-zone-hints", [topo], [eps("web", [
    ep("10.244.1.5", node="node-x", zones=["zone-a"]), ep("10.244.2.6", node="node-y", zones=["zone-b"]),
    ep("10.244.3.7", node="node-z", zones=["zone-a"])])], [
    pkt("only endpoints hinted for this node's zone", POD, "10.96.0.10", 80, "dnat", ["10.244.1.5:8080", "10.244.3.7:8080"]),
]))
cases.append(case("topology-zone-hints-other-zone", [topo], [eps("web", [
    ep("10.244.1.5", node="node-x", zones=["zone-a"]), ep("10.244.2.6", node="node-y", zones=["zone-b"])])], [
    pkt("a node in zone-b gets zone-b's endpoint", POD, "10.96.0.10", 80, "dnat", ["10.244.2.6:8080"]),
], node={"labels": {"topology.kubernetes.io/zone": "zone-b"}}))
cases.append(case("topology-incomplete-hints", [topo], [eps("web", [
    ep("10.244.1.5", node="node-x", zones=["zone-a"]), ep("10.244.2.6", node="node-y")])], [
    pkt("one endpoint without hints: hints ignored", POD, "10.96.0.10", 80, "dnat", WEB),
]))
cases.append(case("topology-no-hint-for-our-zone", [topo], [eps("web", [
    ep("10.244.1.5", node="node-x", zones=["zone-b"]), ep("10.244.2.6", node="node-y", zones=["zone-c"])])], [
    pkt("no endpoint hinted for this zone: every endpoint", POD, "10.96.0.10", 80, "dnat", WEB),
]))
cases.append(case("topology-node-hints", [svc("web", {"clusterIP": "10.96.0.10", "trafficDistribution": "PreferSameNode", "ports": [port()]})], [eps("web", [
    ep("10.244.0.5", node="node-a", zones=["zone-a"], nodes=["node-a"]), ep("10.244.1.5", node="node-x", zones=["zone-a"], nodes=["node-x"])])], [
    pkt("PreferSameNode: the endpoint hinted for this node", POD, "10.96.0.10", 80, "dnat", ["10.244.0.5:8080"]),
]))
cases.append(case("topology-node-hints-fall-back-to-zone", [svc("web", {"clusterIP": "10.96.0.10", "trafficDistribution": "PreferSameNode", "ports": [port()]})], [eps("web", [
    ep("10.244.1.5", node="node-x", zones=["zone-a"], nodes=["node-x"]), ep("10.244.2.6", node="node-y", zones=["zone-b"], nodes=["node-y"])])], [
    pkt("no endpoint for this node: the zone's", POD, "10.96.0.10", 80, "dnat", ["10.244.1.5:8080"]),
]))

# --- IPv6 and dual-stack ClusterIPs -----------------------------------------------------------
web6 = svc("web6", {"clusterIP": "fd00:96::10", "clusterIPs": ["fd00:96::10"], "ipFamilies": ["IPv6"],
                    "ports": [port(53, 5353, "dns", "UDP"), port(80, 8080, "http", "TCP")]})
web6_slice = eps("web6", [ep("fd00:244:1::5"), ep("fd00:244:2::6", node="node-c")], family="IPv6",
                 ports=[{"name": "dns", "protocol": "UDP", "port": 5353}, {"name": "http", "protocol": "TCP", "port": 8080}])
cases.append(case("ipv6-clusterip", [web6], [web6_slice], [
    pkt("pod to IPv6 ClusterIP over UDP", POD6, "fd00:96::10", 53, "dnat", ["[fd00:244:1::5]:5353", "[fd00:244:2::6]:5353"], proto="UDP"),
    pkt("pod to IPv6 ClusterIP over TCP", POD6, "fd00:96::10", 80, "dnat", ["[fd00:244:1::5]:8080", "[fd00:244:2::6]:8080"]),
    pkt("outside the pod network: masqueraded", OUTSIDE6, "fd00:96::10", 80, "dnat", ["[fd00:244:1::5]:8080", "[fd00:244:2::6]:8080"], True),
]))
cases.append(case("ipv6-hairpin-and-reject", [web6, svc("empty6", {"clusterIP": "fd00:96::11", "clusterIPs": ["fd00:96::11"], "ipFamilies": ["IPv6"], "ports": [port()]})],
    [eps("web6", [ep(POD6, node="node-a")], family="IPv6", ports=[{"name": "http", "protocol": "TCP", "port": 8080}])], [
    pkt("IPv6 pod reaching itself: masqueraded", POD6, "fd00:96::10", 80, "dnat", [f"[{POD6}]:8080"], True),
    pkt("IPv6 Service without endpoints: rejected", POD6, "fd00:96::11", 80, "reject"),
    pkt("IPv6 UDP Service without endpoints: rejected (ICMPv6)", POD6, "fd00:96::10", 53, "reject", proto="UDP"),
]))
dual = svc("dual", {"clusterIP": "10.96.0.40", "clusterIPs": ["10.96.0.40", "fd00:96::40"], "ipFamilies": ["IPv4", "IPv6"],
                    "ipFamilyPolicy": "RequireDualStack", "ports": [port()]})
cases.append(case("dual-stack-one-family-of-endpoints", [dual], [eps("dual", [ep("10.244.1.5")])], [
    pkt("IPv4 ClusterIP reaches the IPv4 endpoint", POD, "10.96.0.40", 80, "dnat", ["10.244.1.5:8080"]),
    pkt("IPv6 ClusterIP has no IPv6 endpoint: rejected", POD6, "fd00:96::40", 80, "reject"),
]))

diameter = svc("diameter", {"clusterIP": "10.96.0.50", "ports": [port(3868, 3869, "diameter", "SCTP", node_port=30868)],
                            "type": "NodePort"})
cases.append(case("sctp", [diameter, svc("sctp-empty", {"clusterIP": "10.96.0.51", "ports": [port(3868, 3868, "d", "SCTP")]})],
                  [eps("diameter", [ep("10.244.1.5"), ep("10.244.2.6", node="node-c")],
                       ports=[{"name": "diameter", "protocol": "SCTP", "port": 3869}])], [
    pkt("pod to an SCTP ClusterIP, port rewritten (CRC32c kept valid)", POD, "10.96.0.50", 3868, "dnat",
        ["10.244.1.5:3869", "10.244.2.6:3869"], proto="SCTP"),
    pkt("SCTP NodePort from outside, masqueraded", OUTSIDE, NODE_IP, 30868, "dnat",
        ["10.244.1.5:3869", "10.244.2.6:3869"], True, proto="SCTP"),
    pkt("TCP on the SCTP port is not ours", POD, "10.96.0.50", 3868, "accept"),
    pkt("SCTP Service without endpoints: rejected (ICMP port unreachable)", POD, "10.96.0.51", 3868, "reject", proto="SCTP"),
]))

out = {"node": NODE, "cases": cases}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kube-proxy-parity.json")
with open(path, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(f"{path}: {len(cases)} cases, {sum(len(c['packets']) for c in cases)} packets")
