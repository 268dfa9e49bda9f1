package main

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io/ioutil"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// tlsFiles: the edge's certificate and key (serve TLS only), the CA its clients'
// certificates must chain to (mutual TLS), and the CA of the upstream gateway port.
type tlsFiles struct {
	cert, key, clientCA, upstreamCA string
}

func readPool(path string) (*x509.CertPool, error) {
	pem, err := ioutil.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s holds no PEM certificate", path)
	}
	return pool, nil
}

// keyPair is the edge's own certificate, or nil when it serves plaintext.
func (f tlsFiles) keyPair() (*tls.Certificate, error) {
	if f.cert == "" && f.key == "" {
		if f.clientCA != "" {
			return nil, fmt.Errorf("a client CA (mutual TLS) needs the edge's own certificate and key: set INFERBUS_EDGE_TLS_CERT_FILE and INFERBUS_EDGE_TLS_KEY_FILE")
		}
		return nil, nil
	}
	if f.cert == "" || f.key == "" {
		return nil, fmt.Errorf("TLS needs both INFERBUS_EDGE_TLS_CERT_FILE and INFERBUS_EDGE_TLS_KEY_FILE (got cert %q, key %q)", f.cert, f.key)
	}
	pair, err := tls.LoadX509KeyPair(f.cert, f.key)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate %s and key %s: %w", f.cert, f.key, err)
	}
	return &pair, nil
}

// serverOption: TLS only when a certificate is set, client certificates
// required when a client CA is (as the gateway's own port does).
func (f tlsFiles) serverOption(pair *tls.Certificate) (grpc.ServerOption, error) {
	if pair == nil {
		return nil, nil
	}
	config := &tls.Config{Certificates: []tls.Certificate{*pair}, MinVersion: tls.VersionTLS12}
	if f.clientCA != "" {
		pool, err := readPool(f.clientCA)
		if err != nil {
			return nil, fmt.Errorf("TLS client CA: %w", err)
		}
		config.ClientCAs = pool
		config.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return grpc.Creds(credentials.NewTLS(config)), nil
}

// upstreamOption: how the edge dials the gateway's own port. TLS when an
// upstream CA is set; then the edge's certificate, if it has one, is its client
// certificate (for a gateway port that requires them).
func (f tlsFiles) upstreamOption(pair *tls.Certificate) (grpc.DialOption, error) {
	if f.upstreamCA == "" {
		return grpc.WithInsecure(), nil
	}
	pool, err := readPool(f.upstreamCA)
	if err != nil {
		return nil, fmt.Errorf("upstream CA: %w", err)
	}
	config := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if pair != nil {
		config.Certificates = []tls.Certificate{*pair}
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(config)), nil
}
