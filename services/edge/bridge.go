package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	nats "github.com/nats-io/nats.go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

const service = "/inference.GRPCInferenceService/"

// The calls that are not one request and one answer: proxied, never bridged.
var streaming = map[string]bool{service + "ModelStreamInfer": true}

// frame is one gRPC message's bytes, passed on as they came.
type frame struct{ payload []byte }

// rawCodec moves message bytes without parsing them.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	f, ok := v.(*frame)
	if !ok {
		return nil, fmt.Errorf("edge codec: cannot marshal %T", v)
	}
	return f.payload, nil
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	f, ok := v.(*frame)
	if !ok {
		return fmt.Errorf("edge codec: cannot unmarshal into %T", v)
	}
	// gRPC reuses its receive buffer: keep a copy.
	f.payload = append([]byte(nil), data...)
	return nil
}

func (rawCodec) Name() string   { return "proto" }
func (rawCodec) String() string { return "proto" }

type bridge struct {
	nc       *nats.Conn
	calls    *calls
	subject  string
	maxWait  time.Duration
	upstream *grpc.ClientConn
	stats    *stats
}

// handle serves every call the server receives (it has no registered service).
func (b *bridge) handle(_ interface{}, stream grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(stream)
	if !ok {
		return status.Error(codes.Internal, "edge: the call has no method name")
	}
	if streaming[method] || !strings.HasPrefix(method, service) {
		err := b.proxy(method, stream)
		b.stats.proxied(method, status.Code(err))
		return err
	}
	var req frame
	if err := stream.RecvMsg(&req); err != nil {
		return err
	}
	// Headers and the bus's own framing must fit under max_payload.
	if int64(len(req.payload)) > b.nc.MaxPayload()-64*1024 {
		err := b.proxyUnary(method, stream, &req)
		b.stats.proxied(method, status.Code(err))
		return err
	}
	start := time.Now()
	err := b.unary(method, stream, &req)
	b.stats.observe(method, status.Code(err), time.Since(start))
	return err
}

// unary carries one call to a gateway over NATS and relays its answer.
func (b *bridge) unary(method string, stream grpc.ServerStream, req *frame) error {
	ctx := stream.Context()
	msg := nats.NewMsg(b.subject)
	msg.Data = req.payload
	msg.Header["Ib-Method"] = []string{method}
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		msg.Header["Ib-Peer"] = []string{p.Addr.String()}
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		for key, values := range md {
			// Pseudo-headers, transport headers and binary values stay here, as
			// the gateway's own gRPC port does not show them to the servicer.
			if strings.HasPrefix(key, ":") || strings.HasSuffix(key, "-bin") ||
				key == "content-type" || key == "grpc-accept-encoding" || key == "grpc-encoding" ||
				len(values) == 0 {
				continue
			}
			msg.Header[key] = values[:1]
		}
	}
	wait := b.maxWait
	if deadline, ok := ctx.Deadline(); ok {
		remaining := time.Until(deadline)
		if remaining <= 0 {
			return status.Error(codes.DeadlineExceeded, "the call's deadline passed before it reached a gateway")
		}
		msg.Header["Ib-Timeout-Us"] = []string{strconv.FormatInt(remaining.Microseconds(), 10)}
		wait = remaining
	}
	waitCtx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	call := b.calls.open()
	msg.Reply = call.reply
	msg.Header["Ib-Reply-Frames"] = []string{b.calls.framesSubject()}
	if err := b.nc.PublishMsg(msg); err != nil {
		b.calls.forget(call)
		return busError(ctx, b.subject, err)
	}
	select {
	case a := <-call.answered:
		if a.busErr != nil {
			return busError(ctx, b.subject, a.busErr)
		}
		if len(a.trailer) > 0 {
			stream.SetTrailer(a.trailer)
		}
		if a.err != nil {
			return a.err
		}
		return stream.SendMsg(&frame{payload: a.body})
	case <-waitCtx.Done():
		b.calls.forget(call)
		return busError(ctx, b.subject, waitCtx.Err())
	}
}

// busError is the status a client sees when the bus did not bring an answer.
func busError(ctx context.Context, subject string, err error) error {
	switch {
	case errors.Is(err, errOrphaned):
		return status.Errorf(codes.Unavailable,
			"the gateway process that took this call stopped before answering (killed or frozen: %v); it may have run, retry with the same request id", err)
	case errors.Is(err, errCutOff):
		return status.Error(codes.Unavailable,
			"the edge lost its NATS connection while this call waited, so its answer cannot come back; it may have run, retry with the same request id")
	case errors.Is(err, nats.ErrNoResponders):
		return status.Errorf(codes.Unavailable,
			"no gateway process answers on %s: start one (inferbus up) or check that the gateways run with the edge on", subject)
	case ctx.Err() == context.Canceled:
		return status.Error(codes.Canceled, "the client cancelled the call")
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout):
		return status.Error(codes.DeadlineExceeded, "no answer from a gateway before the call's deadline")
	case errors.Is(err, nats.ErrConnectionClosed) || errors.Is(err, nats.ErrDisconnected) ||
		errors.Is(err, nats.ErrConnectionReconnecting):
		return status.Errorf(codes.Unavailable, "the edge has lost its NATS connection (%v); retry", err)
	default:
		return status.Errorf(codes.Unavailable, "edge: the request could not be carried to a gateway: %v", err)
	}
}

// proxyUnary sends an already-read unary request to the upstream gateway port.
func (b *bridge) proxyUnary(method string, stream grpc.ServerStream, req *frame) error {
	if b.upstream == nil {
		return status.Errorf(codes.ResourceExhausted,
			"the request is %d bytes, more than the bus carries (max_payload %d), and the edge has no -upstream gateway port to send it to",
			len(req.payload), b.nc.MaxPayload())
	}
	return b.forward(method, stream, req)
}

// proxy passes a call through to the upstream gateway, frame by frame.
func (b *bridge) proxy(method string, stream grpc.ServerStream) error {
	if b.upstream == nil {
		return status.Errorf(codes.Unimplemented,
			"%s is not carried over the bus and the edge has no -upstream gateway port; call the gateway's own gRPC port",
			method)
	}
	return b.forward(method, stream, nil)
}

func (b *bridge) forward(method string, stream grpc.ServerStream, first *frame) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		out := metadata.MD{}
		for key, values := range md {
			if !strings.HasPrefix(key, ":") && key != "content-type" {
				out[key] = values
			}
		}
		ctx = metadata.NewOutgoingContext(ctx, out)
	}
	desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
	client, err := b.upstream.NewStream(ctx, desc, method, grpc.ForceCodec(rawCodec{}))
	if err != nil {
		return err
	}
	sent := make(chan error, 1)
	go func() {
		if first != nil {
			if err := client.SendMsg(first); err != nil {
				sent <- err
				return
			}
		}
		for {
			var f frame
			if err := stream.RecvMsg(&f); err != nil {
				if err == io.EOF {
					sent <- client.CloseSend()
				} else {
					sent <- err
				}
				return
			}
			if err := client.SendMsg(&f); err != nil {
				sent <- err
				return
			}
		}
	}()
	headerSent := false
	for {
		var f frame
		err := client.RecvMsg(&f)
		if !headerSent {
			if md, mdErr := client.Header(); mdErr == nil && len(md) > 0 {
				_ = stream.SendHeader(md)
			}
			headerSent = true
		}
		if err != nil {
			stream.SetTrailer(client.Trailer())
			if err == io.EOF {
				return nil
			}
			return err
		}
		if err := stream.SendMsg(&f); err != nil {
			return err
		}
		select {
		case err := <-sent:
			if err != nil && err != io.EOF {
				return err
			}
			sent = nil
		default:
		}
	}
}

func dialUpstream(target string, maxMessage int, security grpc.DialOption) (*grpc.ClientConn, error) {
	return grpc.Dial(target,
		security,
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(maxMessage),
			grpc.MaxCallSendMsgSize(maxMessage),
		),
	)
}
