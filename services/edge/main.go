// Command inferbus-edge terminates KServe V2 gRPC outside Python and carries each
// unary call to the gateway processes over NATS.
//
// Why: a grpc.aio server accepts one call per method at a time and re-arms the
// accept only after the call has come back through its event loop, so a gateway
// whose loop also runs the pipeline and NATS caps how many calls one HTTP/2
// connection gets per second (bench/findings.md, rounds 14 and 15). Here gRPC is
// served by grpc-go; every unary call of inference.GRPCInferenceService becomes
// one NATS request on <prefix>.edge.grpc, answered by whichever gateway process
// of the queue group "gateway" takes it (so one client connection's calls spread
// over every gateway process of the host). The request body is the call's
// protobuf bytes, untouched; the gateway decodes it with the same servicer it
// uses for its own gRPC port.
//
// Contract (docs/architecture.md, "The gRPC edge"):
//
//	request headers  Ib-Method       full method, "/inference.GRPCInferenceService/ModelInfer"
//	                 Ib-Timeout-Us   the client's remaining deadline (absent: none)
//	                 Ib-Peer         the client's address
//	                 <key>           each text metadata entry of the call (lowercase keys)
//	                 Ib-Reply-Frames where the gateway may send reply frames (replies.go)
//	reply headers    Ib-Status       the gRPC status code (absent: OK)
//	                 Ib-Message      the status message
//	                 <key>           trailing metadata (lowercase keys)
//
// A gateway answers either on the call's own reply subject with those headers,
// or, gathered with the other answers it has ready for this edge, in a reply
// frame (replies.go has the layout). While it holds calls longer than 250 ms it
// claims them (replies.go, "Claims"); a call no gateway claims for -orphan-after
// (1 s), and every call waiting when the NATS connection drops, is answered
// UNAVAILABLE at once instead of at its deadline.
//
// Configuration: flags, each defaulting to an INFERBUS_EDGE_* variable (-help).
//
// Calls that do not fit a request/reply (ModelStreamInfer, other services) and
// requests larger than the bus's max_payload are proxied, frame by frame, to a
// gateway's own gRPC port (-upstream).
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"io/ioutil"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	nats "github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	_ "google.golang.org/grpc/encoding/gzip" // clients that compress their requests
)

type options struct {
	host         string
	grpcPort     int
	metricsPort  int
	upstream     string
	natsURL      string
	natsUser     string
	natsPassFile string
	natsCreds    string
	subject      string
	maxMessage   int
	maxWait      time.Duration
	orphanAfter  time.Duration
	drain        time.Duration
	portsFile    string
	profiling    bool
	inboxPrefix  string
	tls          tlsFiles
	probe        string
}

// env reads INFERBUS_EDGE_<name>, as the Python services read their settings.
func env(name, fallback string) string {
	if v, ok := os.LookupEnv("INFERBUS_EDGE_" + name); ok {
		return v
	}
	return fallback
}

func envInt(name string, fallback int) int {
	v := env(name, "")
	if v == "" {
		return fallback
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		log.Fatalf("edge: INFERBUS_EDGE_%s=%q is not a whole number", name, v)
	}
	return n
}

func envDuration(name string, fallback time.Duration) time.Duration {
	v := env(name, "")
	if v == "" {
		return fallback
	}
	d, err := time.ParseDuration(v)
	if err != nil || d < 0 {
		log.Fatalf("edge: INFERBUS_EDGE_%s=%q is not a duration such as 1s or 500ms", name, v)
	}
	return d
}

// parseOptions: each flag defaults to its INFERBUS_EDGE_* variable.
func parseOptions() options {
	var o options
	prefix := env("SUBJECT_PREFIX", "ib")
	flag.StringVar(&o.host, "host", env("HOST", "127.0.0.1"), "address to listen on (INFERBUS_EDGE_HOST)")
	flag.IntVar(&o.grpcPort, "grpc-port", envInt("GRPC_PORT", 8003), "KServe V2 gRPC port, 0: any free port (INFERBUS_EDGE_GRPC_PORT)")
	flag.IntVar(&o.metricsPort, "metrics-port", envInt("METRICS_PORT", 8004), "/metrics, /livez and /readyz, 0: any free port, -1: off (INFERBUS_EDGE_METRICS_PORT)")
	flag.StringVar(&o.upstream, "upstream", env("UPSTREAM", ""), "HOST:PORT of a gateway's own gRPC port, for streams, other services and requests past max_payload; empty: those are refused (INFERBUS_EDGE_UPSTREAM)")
	flag.StringVar(&o.natsURL, "nats", env("NATS_URL", "nats://127.0.0.1:4222"), "NATS server URL(s), comma-separated (INFERBUS_EDGE_NATS_URL)")
	flag.StringVar(&o.natsUser, "nats-user", env("NATS_USER", ""), "NATS user (INFERBUS_EDGE_NATS_USER)")
	flag.StringVar(&o.natsPassFile, "nats-password-file", env("NATS_PASSWORD_FILE", ""), "file holding the NATS user's password (INFERBUS_EDGE_NATS_PASSWORD_FILE)")
	flag.StringVar(&o.natsCreds, "nats-creds", env("NATS_CREDS_FILE", ""), "NATS credentials file (INFERBUS_EDGE_NATS_CREDS_FILE)")
	flag.StringVar(&o.subject, "subject", prefix+".edge.grpc", "subject the gateways answer edge calls on: <INFERBUS_EDGE_SUBJECT_PREFIX>.edge.grpc")
	flag.IntVar(&o.maxMessage, "max-message-bytes", envInt("MAX_MESSAGE_BYTES", 64<<20), "largest gRPC message received or sent (INFERBUS_EDGE_MAX_MESSAGE_BYTES)")
	flag.DurationVar(&o.maxWait, "max-wait", 300*time.Second, "longest wait for a gateway's answer to a call with no deadline")
	flag.DurationVar(&o.orphanAfter, "orphan-after", envDuration("ORPHAN_AFTER", time.Second), "answer UNAVAILABLE a call no gateway has claimed for this long (its gateway was killed or froze); 0: off, for gateways from before claims (INFERBUS_EDGE_ORPHAN_AFTER)")
	flag.DurationVar(&o.drain, "drain", 10*time.Second, "on SIGTERM, how long in-flight calls may take")
	flag.StringVar(&o.portsFile, "ports-file", env("PORTS_FILE", ""), "write {\"pid\", \"grpc\", \"metrics\"} here once serving (INFERBUS_EDGE_PORTS_FILE)")
	flag.StringVar(&o.inboxPrefix, "nats-inbox-prefix", env("NATS_INBOX_PREFIX", ""), "prefix of the edge's reply inboxes; empty: _INBOX_<nats user> with a user (the secure stack's permissions), _INBOX without (INFERBUS_EDGE_NATS_INBOX_PREFIX)")
	flag.StringVar(&o.tls.cert, "tls-cert-file", env("TLS_CERT_FILE", ""), "PEM certificate (chain); with -tls-key-file the gRPC port serves TLS only (INFERBUS_EDGE_TLS_CERT_FILE)")
	flag.StringVar(&o.tls.key, "tls-key-file", env("TLS_KEY_FILE", ""), "PEM private key of -tls-cert-file (INFERBUS_EDGE_TLS_KEY_FILE)")
	flag.StringVar(&o.tls.clientCA, "tls-client-ca-file", env("TLS_CLIENT_CA_FILE", ""), "PEM CA bundle; when set, clients must present a certificate it signed (INFERBUS_EDGE_TLS_CLIENT_CA_FILE)")
	flag.StringVar(&o.tls.upstreamCA, "upstream-ca-file", env("UPSTREAM_CA_FILE", ""), "PEM CA bundle of the upstream gateway port's certificate; when set the edge dials it over TLS (INFERBUS_EDGE_UPSTREAM_CA_FILE)")
	flag.StringVar(&o.probe, "probe", "", "check URL (e.g. http://127.0.0.1:8004/readyz) and exit: 0 when it answers 200 (a container's health check; the image has no curl)")
	flag.BoolVar(&o.profiling, "pprof", env("PPROF", "") == "true", "serve Go's profiler under /debug/pprof/ on the metrics port (INFERBUS_EDGE_PPROF=true)")
	flag.Parse()
	return o
}

// connectNATS connects; each time the connection drops, `lost` gets a signal
// (without blocking) so the calls waiting on answers are answered at once.
func connectNATS(o options, lost chan<- struct{}) (*nats.Conn, error) {
	opts := []nats.Option{
		nats.Name("inferbus-edge"),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			log.Printf("edge: NATS disconnected: %v", err)
			select {
			case lost <- struct{}{}:
			default:
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Printf("edge: NATS reconnected to %s", nc.ConnectedUrl())
		}),
		// Asynchronous errors, a permissions violation among them: in the log, where
		// an operator of a secured stack looks first.
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			if sub != nil {
				log.Printf("edge: NATS error on %s: %v", sub.Subject, err)
				return
			}
			log.Printf("edge: NATS error: %v", err)
		}),
	}
	if o.natsUser != "" {
		password := ""
		if o.natsPassFile != "" {
			data, err := ioutil.ReadFile(o.natsPassFile)
			if err != nil {
				return nil, fmt.Errorf("NATS password file: %w", err)
			}
			password = strings.TrimSpace(string(data))
		}
		opts = append(opts, nats.UserInfo(o.natsUser, password))
	}
	if o.natsCreds != "" {
		opts = append(opts, nats.UserCredentials(o.natsCreds))
	}
	// Each NATS user of a secured installation reads answers on its own inbox
	// prefix (inferbus_common.security.inbox_prefix).
	inbox := o.inboxPrefix
	if inbox == "" && o.natsUser != "" {
		inbox = "_INBOX_" + o.natsUser
	}
	if inbox != "" {
		opts = append(opts, nats.CustomInboxPrefix(inbox))
	}
	return nats.Connect(o.natsURL, opts...)
}

// probe: 0 when url answers 200 within 3 s, else 1 with the reason on stderr.
func probe(url string) int {
	client := http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		fmt.Fprintf(os.Stderr, "probe %s: %v\n", url, err)
		return 1
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := ioutil.ReadAll(io.LimitReader(resp.Body, 512))
		fmt.Fprintf(os.Stderr, "probe %s: %s %s\n", url, resp.Status, strings.TrimSpace(string(body)))
		return 1
	}
	return 0
}

func writePortsFile(path string, grpcPort, metricsPort int) error {
	if path == "" {
		return nil
	}
	body := fmt.Sprintf("{\"pid\": %d, \"grpc\": %d, \"metrics\": %d}\n", os.Getpid(), grpcPort, metricsPort)
	tmp := path + ".tmp"
	if err := ioutil.WriteFile(tmp, []byte(body), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func main() {
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	o := parseOptions()
	if o.probe != "" {
		os.Exit(probe(o.probe))
	}

	pair, err := o.tls.keyPair()
	if err != nil {
		log.Fatalf("edge: %v", err)
	}
	serverTLS, err := o.tls.serverOption(pair)
	if err != nil {
		log.Fatalf("edge: %v", err)
	}
	upstreamTLS, err := o.tls.upstreamOption(pair)
	if err != nil {
		log.Fatalf("edge: %v", err)
	}
	listen := net.JoinHostPort(o.host, strconv.Itoa(o.grpcPort))
	lis, err := net.Listen("tcp", listen)
	if err != nil {
		// A taken port fails loudly, like the gateway's.
		log.Fatalf("edge: cannot listen on %s: %v", listen, err)
	}
	lost := make(chan struct{}, 1)
	nc, err := connectNATS(o, lost)
	if err != nil {
		log.Fatalf("edge: cannot connect to NATS at %s: %v", o.natsURL, err)
	}
	stats := newStats()
	answers, err := newCalls(nc, stats)
	if err != nil {
		log.Fatalf("edge: cannot subscribe to its answer inbox: %v", err)
	}
	// Answers on their way when the connection drops are lost with it: the calls
	// waiting for them are answered now, not at their deadlines.
	go func() {
		for range lost {
			if n := answers.cutOff(); n > 0 {
				log.Printf("edge: %d call(s) waiting when NATS dropped answered UNAVAILABLE", n)
			}
		}
	}()
	if o.orphanAfter > 0 {
		go answers.watch(o.orphanAfter)
	}
	bridge := &bridge{nc: nc, calls: answers, subject: o.subject, maxWait: o.maxWait, stats: stats}
	if o.upstream != "" {
		bridge.upstream, err = dialUpstream(o.upstream, o.maxMessage, upstreamTLS)
		if err != nil {
			log.Fatalf("edge: upstream %s: %v", o.upstream, err)
		}
	}
	serverOptions := []grpc.ServerOption{
		grpc.CustomCodec(rawCodec{}),
		grpc.UnknownServiceHandler(bridge.handle),
		grpc.MaxRecvMsgSize(o.maxMessage),
		grpc.MaxSendMsgSize(o.maxMessage),
	}
	if serverTLS != nil {
		serverOptions = append(serverOptions, serverTLS)
	}
	server := grpc.NewServer(serverOptions...)
	metricsPort := 0
	if o.metricsPort >= 0 {
		addr := net.JoinHostPort(o.host, strconv.Itoa(o.metricsPort))
		metricsPort, err = serveMetrics(addr, stats, nc, o.profiling)
		if err != nil {
			log.Fatalf("edge: metrics on %s: %v", addr, err)
		}
	}
	grpcPort := lis.Addr().(*net.TCPAddr).Port
	if err := writePortsFile(o.portsFile, grpcPort, metricsPort); err != nil {
		log.Fatalf("edge: ports file: %v", err)
	}
	security := "plaintext"
	if serverTLS != nil {
		security = "TLS"
		if o.tls.clientCA != "" {
			security = "mutual TLS"
		}
	}
	log.Printf("edge serving gRPC (%s) on %s, calls to NATS %q at %s, upstream %q",
		security, lis.Addr(), o.subject, nc.ConnectedUrl(), o.upstream)

	done := make(chan error, 1)
	go func() { done <- server.Serve(lis) }()
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	select {
	case sig := <-signals:
		log.Printf("edge draining (%v)", sig)
		stopped := make(chan struct{})
		go func() { server.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(o.drain):
			log.Printf("edge: calls still open after %v; closing them", o.drain)
			server.Stop()
		}
	case err := <-done:
		if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			log.Fatalf("edge: serve: %v", err)
		}
	}
	_ = nc.Drain()
	if bridge.upstream != nil {
		_ = bridge.upstream.Close()
	}
	for deadline := time.Now().Add(2 * time.Second); !nc.IsClosed() && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
}
