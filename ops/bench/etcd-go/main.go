// Command etcd-profile drives loadgen's `profile` load (loadgen/src/profile/peers) at an
// etcd 3.4 cluster with etcd's own Go client, clientv3 and its concurrency package, of the
// server's own version (Debian's golang-etcd-server-dev, 3.4.23). It exists to check the
// Rust etcd client loadgen uses: where both are run at the same load on the same cluster
// and pinning, a difference is the client's, a likeness is etcd's.
//
// The load, as `loadgen --scale S --reads uncached --etcd-lease-per-client profile`:
// `-sessions` sessions, one lease per clientv3 client of up to 2 000 sessions (at least
// one client per member), kept alive by clientv3 (a renewal every third of the TTL);
// 30 % of the sessions hold a lock all run (concurrency.Mutex) and 10 % take one once a
// period (a third of the run, at most 60 s; held 1 s); every session reads one of 100
// config values once a second, linearizable, open loop (each read sent when due and
// timed from then, 5 s deadline); one writer puts a config value 10 times a second
// (a failed put retried after 20 ms); `-fault kill|freeze` kills or stops the leader
// 40 % into the run. Session churn is left out: with a lease per client it costs etcd
// nothing (loadgen's note says the same).
//
// `-scenario failover -fault kill|freeze` runs loadgen's `failover` instead (failover.go).
//
// Build and run: ops/bench/etcd-go/run.sh (it starts the cluster with ops/bench/peers.sh).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"net/http"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.etcd.io/etcd/clientv3"
	"go.etcd.io/etcd/clientv3/concurrency"
	"google.golang.org/grpc/status"
)

const (
	perClient  = 2000
	configKeys = 100
)

// lat keeps every sample of one latency row (a 60 s run has at most a few hundred
// thousand).
type lat struct {
	mu sync.Mutex
	d  []float64 // milliseconds
}

func (l *lat) add(d time.Duration) {
	l.mu.Lock()
	l.d = append(l.d, float64(d)/1e6)
	l.mu.Unlock()
}

// row is one latency row of the report: successes' percentiles and the failures.
type row struct {
	Count  int     `json:"count"`
	Failed int64   `json:"failed"`
	P50    float64 `json:"p50_ms"`
	P99    float64 `json:"p99_ms"`
	Max    float64 `json:"max_ms"`
}

func (l *lat) row(failed int64) row {
	l.mu.Lock()
	defer l.mu.Unlock()
	d := append([]float64(nil), l.d...)
	sort.Float64s(d)
	r := row{Count: len(d), Failed: failed}
	if len(d) > 0 {
		at := func(p float64) float64 { return d[int(p*float64(len(d)-1))] }
		r.P50, r.P99, r.Max = at(0.50), at(0.99), d[len(d)-1]
	}
	return r
}

// member is an etcd member started by peers.sh: its name, pid and client address.
type member struct {
	name, addr string
	pid        int
}

func readPids(path string) ([]member, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var ms []member
	s := bufio.NewScanner(f)
	for s.Scan() {
		p := strings.Fields(s.Text())
		if len(p) != 3 {
			continue
		}
		pid, err := strconv.Atoi(p[1])
		if err != nil {
			return nil, fmt.Errorf("%s: bad pid %q", path, p[1])
		}
		ms = append(ms, member{name: p[0], pid: pid, addr: p[2]})
	}
	return ms, s.Err()
}

// procCost is a process's CPU seconds and peak RSS (MB), from /proc.
func procCost(pid int) (cpu float64, rssMB float64) {
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
		s := string(b)
		f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
		if len(f) > 12 {
			u, _ := strconv.ParseFloat(f[11], 64)
			st, _ := strconv.ParseFloat(f[12], 64)
			cpu = (u + st) / 100 // USER_HZ
		}
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "VmHWM:") {
				kb, _ := strconv.ParseFloat(strings.Fields(l)[1], 64)
				rssMB = kb / 1024
			}
		}
	}
	return
}

// handled is, per member that answers /metrics and per "method code", etcd's
// grpc_server_handled_total.
func handled(ms []member) map[string]map[string]float64 {
	all := map[string]map[string]float64{}
	hc := http.Client{Timeout: 3 * time.Second}
	for _, m := range ms {
		r, err := hc.Get("http://" + m.addr + "/metrics")
		if err != nil {
			continue
		}
		out := map[string]float64{}
		all[m.name] = out
		s := bufio.NewScanner(r.Body)
		s.Buffer(make([]byte, 1<<20), 1<<20)
		for s.Scan() {
			l := s.Text()
			if !strings.HasPrefix(l, "grpc_server_handled_total{") {
				continue
			}
			label := func(k string) string {
				i := strings.Index(l, k+"=\"")
				if i < 0 {
					return ""
				}
				rest := l[i+len(k)+2:]
				return rest[:strings.Index(rest, "\"")]
			}
			v, err := strconv.ParseFloat(l[strings.LastIndex(l, " ")+1:], 64)
			if err == nil && v > 0 {
				out[label("grpc_method")+" "+label("grpc_code")] += v
			}
		}
		r.Body.Close()
	}
	return all
}

// leader is the member that says it leads, asked for up to 30 s (a member on a busy core
// may take seconds to answer), or nil.
func leader(c *clientv3.Client, ms []member) *member {
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); {
		for i := range ms {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			st, err := c.Status(ctx, ms[i].addr)
			cancel()
			if err == nil && st.Leader == st.Header.MemberId {
				return &ms[i]
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return nil
}

// keeper is one client's lease, renewed by clientv3, with when its last renewal was
// answered (for jeopardy) and whether clientv3 gave it up (its channel closed).
type keeper struct {
	id      clientv3.LeaseID
	last    atomic.Int64 // unix nanos
	closed  atomic.Bool
	renewed atomic.Int64
}

func main() {
	var (
		endpoints = flag.String("endpoints", "", "client endpoints, comma-separated (host:port)")
		pidsPath  = flag.String("pids", "", "peers.sh's pids file (for the fault and the members' CPU and memory)")
		sessions  = flag.Int("sessions", 10000, "sessions (loadgen --scale 0.2: 10 000)")
		secs      = flag.Float64("secs", 60, "run length in seconds")
		fault     = flag.String("fault", "", "kill or freeze the leader 40 % into the run (empty: none)")
		scenario  = flag.String("scenario", "profile", "profile, or failover (loadgen's: 16 writers, the leader killed or frozen 3 s in; needs -fault)")
		leaseSecs = flag.Int64("lease", 12, "lease TTL in seconds")
		timeout   = flag.Duration("timeout", 5*time.Second, "deadline of every request")
		out       = flag.String("out", "", "write the figures here as JSON too")
	)
	flag.Parse()
	if *endpoints == "" || *pidsPath == "" {
		fmt.Fprintln(os.Stderr, "etcd-profile: -endpoints and -pids are needed")
		os.Exit(2)
	}
	if *fault != "" && *fault != "kill" && *fault != "freeze" {
		fmt.Fprintln(os.Stderr, "etcd-profile: -fault is kill or freeze")
		os.Exit(2)
	}
	eps := strings.Split(*endpoints, ",")
	ms, err := readPids(*pidsPath)
	must(err)
	switch *scenario {
	case "profile":
	case "failover":
		if *fault == "" {
			fmt.Fprintln(os.Stderr, "etcd-profile: -scenario failover needs -fault kill or freeze")
			os.Exit(2)
		}
		report(failover(eps, ms, *fault == "freeze", *timeout), *out)
		return
	default:
		fmt.Fprintln(os.Stderr, "etcd-profile: -scenario is profile or failover")
		os.Exit(2)
	}
	dur := time.Duration(*secs * float64(time.Second))
	lease := time.Duration(*leaseSecs) * time.Second
	n := *sessions
	longLocks := minI(maxI(int(float64(n)*0.3+0.5), 10), n)
	shortLocks := minI(maxI(int(float64(n)*0.1+0.5), 5), n-longLocks)
	period := 60 * time.Second
	if dur/3 < period {
		period = dur / 3
	}

	admin, err := clientv3.New(config(eps, 0))
	must(err)
	for k := 0; k < configKeys; k++ {
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		_, err := admin.Put(ctx, fmt.Sprintf("/profile/config/k%d", k), strings.Repeat("v", 100))
		cancel()
		must(err)
	}

	// Clients, each with one lease shared by its sessions.
	nc := maxI(maxI((n+perClient-1)/perClient, len(eps)), 1)
	clients := make([]*clientv3.Client, nc)
	keepers := make([]*keeper, nc)
	sess := make([]*concurrency.Session, nc)
	for i := range clients {
		clients[i], err = clientv3.New(config(eps, i))
		must(err)
		ctx, cancel := context.WithTimeout(context.Background(), *timeout)
		g, err := clients[i].Grant(ctx, *leaseSecs)
		cancel()
		must(err)
		k := &keeper{id: g.ID}
		k.last.Store(time.Now().UnixNano())
		ch, err := clients[i].KeepAlive(context.Background(), g.ID)
		must(err)
		go func() {
			for r := range ch {
				if r != nil {
					k.last.Store(time.Now().UnixNano())
					k.renewed.Add(1)
				}
			}
			// clientv3 closed the channel: no renewal answered for a TTL, or the server
			// said the lease is gone (TTL 0); the two are not told apart here.
			k.closed.Store(true)
		}()
		keepers[i] = k
		// The concurrency session on the same lease (clientv3 renews a lease once
		// however many keep-alives ask for it).
		sess[i], err = concurrency.NewSession(clients[i], concurrency.WithLease(g.ID))
		must(err)
	}
	of := func(i int) int { return i % nc }
	lockDir := func(i int) string { return fmt.Sprintf("/profile/locks/l%d", i) }

	// Long-held locks, 128 at a time.
	opened := time.Now()
	var setupErrors atomic.Int64
	sem := make(chan struct{}, 128)
	var wg sync.WaitGroup
	for i := 0; i < longLocks; i++ {
		sem <- struct{}{}
		wg.Add(1)
		go func(i int) {
			defer func() { <-sem; wg.Done() }()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := concurrency.NewMutex(sess[of(i)], lockDir(i)).Lock(ctx); err != nil {
				if setupErrors.Add(1) == 1 {
					fmt.Fprintln(os.Stderr, "etcd-profile: a long-held lock was not taken:", err)
				}
			}
		}(i)
	}
	wg.Wait()
	setupSecs := time.Since(opened).Seconds()

	before := handled(ms)
	cpu0 := map[int]float64{}
	for _, m := range ms {
		cpu0[m.pid], _ = procCost(m.pid)
	}
	start := time.Now()
	deadline := start.Add(dur)
	var (
		acq, rd, wr, late                        lat
		acqFailed, rdFailed, wrFailed, relFailed atomic.Int64
		writesOK                                 []time.Time
		writesMu                                 sync.Mutex
		runWG                                    sync.WaitGroup
	)

	// Short locks: each taken once a period at a random offset, held 1 s.
	for j := 0; j < shortLocks; j++ {
		i := longLocks + j
		runWG.Add(1)
		go func(i int) {
			defer runWG.Done()
			for due := start.Add(time.Duration(rand.Float64() * float64(period))); due.Before(deadline); due = due.Add(period) {
				time.Sleep(time.Until(due))
				m := concurrency.NewMutex(sess[of(i)], lockDir(i))
				t0 := time.Now()
				ctx, cancel := context.WithTimeout(context.Background(), *timeout)
				err := m.Lock(ctx)
				cancel()
				if err != nil {
					acqFailed.Add(1)
					continue
				}
				acq.add(time.Since(t0))
				time.Sleep(time.Second)
				ctx, cancel = context.WithTimeout(context.Background(), *timeout)
				if m.Unlock(ctx) != nil {
					relFailed.Add(1)
				}
				cancel()
			}
		}(i)
	}

	// Readers: groups of 50 sessions, each session once a second, spread over the
	// second; a read is sent when due (whether or not earlier ones were answered) and
	// timed from then.
	var reads atomic.Int64
	for first := 0; first < n; first += 50 {
		g := minI(50, n-first)
		runWG.Add(1)
		go func(first, g int) {
			defer runWG.Done()
			step := time.Second / time.Duration(g)
			t := start.Add(time.Duration(rand.Float64() * float64(time.Second)))
			var inflight sync.WaitGroup
			for k := 0; ; k++ {
				due := t.Add(time.Duration(k) * step)
				if !due.Before(deadline) {
					break
				}
				time.Sleep(time.Until(due))
				i := first + k%g
				inflight.Add(1)
				go func(i int, due time.Time) {
					defer inflight.Done()
					ctx, cancel := context.WithTimeout(context.Background(), *timeout)
					_, err := clients[of(i)].Get(ctx, fmt.Sprintf("/profile/config/k%d", i%configKeys))
					cancel()
					if err != nil {
						rdFailed.Add(1)
						why(err)
						return
					}
					rd.add(time.Since(due))
					reads.Add(1)
				}(i, due)
			}
			inflight.Wait()
		}(first, g)
	}

	// The config writer, on its own client.
	wc, err := clientv3.New(config(eps, 1))
	must(err)
	runWG.Add(1)
	go func() {
		defer runWG.Done()
		for v := 0; time.Now().Before(deadline); {
			t0 := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), *timeout)
			_, err := wc.Put(ctx, fmt.Sprintf("/profile/config/k%d", v%configKeys), fmt.Sprintf("%0100d", v))
			cancel()
			if err != nil {
				wrFailed.Add(1)
				time.Sleep(20 * time.Millisecond)
				continue
			}
			t1 := time.Now()
			wr.add(t1.Sub(t0))
			writesMu.Lock()
			writesOK = append(writesOK, t1)
			writesMu.Unlock()
			v++
			time.Sleep(time.Until(t0.Add(100 * time.Millisecond)))
		}
	}()

	// This process's own lateness (a 10 ms timer, how late it ran).
	runWG.Add(1)
	go func() {
		defer runWG.Done()
		for time.Now().Before(deadline) {
			due := time.Now().Add(10 * time.Millisecond)
			time.Sleep(10 * time.Millisecond)
			late.add(time.Since(due))
		}
	}()

	// Jeopardy: a lease whose last renewal was answered longer than its TTL ago, every
	// 200 ms; all of its client's sessions count.
	sessionsOf := func(c int) int { return (n - c + nc - 1) / nc }
	ever := make([]bool, nc)
	most := 0
	runWG.Add(1)
	go func() {
		defer runWG.Done()
		for time.Now().Before(deadline) {
			now, at := time.Now().UnixNano(), 0
			for c, k := range keepers {
				if now-k.last.Load() > int64(lease) {
					ever[c] = true
					at += sessionsOf(c)
				}
			}
			most = maxI(most, at)
			time.Sleep(200 * time.Millisecond)
		}
	}()

	// The fault, 40 % into the run.
	var faulted *member
	var faultAt time.Time
	if *fault != "" {
		time.Sleep(time.Until(start.Add(dur * 4 / 10)))
		faulted = leader(admin, ms)
		if faulted == nil {
			fmt.Fprintln(os.Stderr, "etcd-profile: no leader found for the fault")
			os.Exit(1)
		}
		sig := syscall.SIGKILL
		if *fault == "freeze" {
			sig = syscall.SIGSTOP
		}
		faultAt = time.Now()
		must(syscall.Kill(faulted.pid, sig))
	}
	runWG.Wait()
	renewed0 := int64(0)
	for _, k := range keepers {
		renewed0 += k.renewed.Load()
	}
	elapsed := time.Since(start).Seconds()

	// Members' CPU during the run and peak memory, and what the servers answered.
	after := handled(ms)
	type cost struct {
		CPU   float64 `json:"cpu_secs"`
		RSSMB float64 `json:"peak_rss_mb"`
	}
	costs := map[string]cost{}
	for _, m := range ms {
		if faulted != nil && m.pid == faulted.pid && *fault == "kill" {
			continue
		}
		c, r := procCost(m.pid)
		costs[m.name] = cost{c - cpu0[m.pid], r}
	}
	// The server's check, a lease after the run: which leases still exist.
	time.Sleep(lease + 5*time.Second)
	// A lease is lost when the server answers TTL -1 (no such lease); one no member
	// answered for in three tries is unknown.
	alive, gone, unknown, clientGaveUp := 0, 0, 0, 0
	for _, k := range keepers {
		ttl, answered := int64(0), false
		for try := 0; try < 3 && !answered; try++ {
			ctx, cancel := context.WithTimeout(context.Background(), *timeout)
			r, err := admin.TimeToLive(ctx, k.id)
			cancel()
			if err == nil {
				ttl, answered = r.TTL, true
			}
		}
		switch {
		case !answered:
			unknown++
		case ttl >= 0: // TTL -1: no such lease; 0: still there, under a second left
			alive++
		default:
			gone++
		}
		if k.closed.Load() {
			clientGaveUp++
		}
	}
	if faulted != nil && *fault == "freeze" {
		_ = syscall.Kill(faulted.pid, syscall.SIGCONT)
	}

	unavail := 0.0
	if faulted != nil {
		unavail = unavailable(writesOK, faultAt, deadline.Sub(faultAt))
	}
	jeopardyEver := 0
	for c, e := range ever {
		if e {
			jeopardyEver += sessionsOf(c)
		}
	}
	// Only members that answered before and after the run: a killed or frozen one's
	// answers are not in it.
	delta := map[string]float64{}
	for name, counts := range after {
		b, ok := before[name]
		if !ok {
			continue
		}
		for k, v := range counts {
			if d := v - b[k]; d > 0 {
				delta[k] += d
			}
		}
	}
	res := map[string]any{
		"client":                               "clientv3 3.4.23 (Debian golang-etcd-server-dev), Go " + strings.TrimPrefix(runtime.Version(), "go"),
		"sessions":                             n,
		"clients (one lease each)":             nc,
		"locks held all run":                   longLocks,
		"short locks":                          shortLocks,
		"short lock period (s)":                period.Seconds(),
		"run (s)":                              elapsed,
		"setup: long locks taken (s)":          setupSecs,
		"setup errors":                         setupErrors.Load(),
		"acquire (short locks)":                acq.row(acqFailed.Load()),
		"releases failed":                      relFailed.Load(),
		"config read (uncached)":               rd.row(rdFailed.Load()),
		"config reads per s (at clients)":      float64(reads.Load()) / elapsed,
		"config write":                         wr.row(wrFailed.Load()),
		"lateness (10 ms timer)":               late.row(0),
		"sessions in jeopardy at some point":   jeopardyEver,
		"sessions in jeopardy at once (most)":  most,
		"leases the server still has":          alive,
		"leases the server confirms lost":      gone,
		"leases the server did not answer for": unknown,
		"config reads failed, by gRPC code":    reasons,
		"leases clientv3 gave up":              clientGaveUp,
		"leases renewed per s":                 float64(renewed0) / elapsed,
		"server: gRPC requests answered in the run (method code), members that answered /metrics before and after": delta,
		"members (CPU s in the run, peak RSS MB)": costs,
	}
	if faulted != nil {
		res["fault"] = fmt.Sprintf("leader %s (%s) %s at %.1f s", faulted.name, faulted.addr, *fault, faultAt.Sub(start).Seconds())
		res["config writes unavailable (s)"] = unavail
	}
	report(res, *out)
}

// unavailable is loadgen's unavailability after event (loadgen/src/scenarios/mod.rs):
// from it to the first success after it, or the longest gap between successes after it
// if that is longer; none (in seconds) if nothing succeeded after it.
func unavailable(successes []time.Time, event time.Time, none time.Duration) float64 {
	ts := append([]time.Time(nil), successes...)
	sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
	gap, prev := 0.0, event
	for _, t := range ts {
		if t.After(event) {
			if d := t.Sub(prev).Seconds(); d > gap {
				gap = d
			}
			prev = t
		}
	}
	if prev == event {
		return none.Seconds()
	}
	return gap
}

// report prints res as JSON and writes it to out too unless out is empty.
func report(res map[string]any, out string) {
	b, _ := json.MarshalIndent(res, "", "  ")
	fmt.Println(string(b))
	if out != "" {
		must(os.WriteFile(out, b, 0o644))
	}
}

// config is the clientv3 configuration of the i-th client: every endpoint, starting at
// the i-th.
func config(eps []string, i int) clientv3.Config {
	e := append([]string(nil), eps...)
	k := i % len(e)
	e = append(e[k:], e[:k]...)
	// HTTP/2 keep-alive: a ping after 10 s without a frame, as loadgen's (only with
	// a stream open; etcd allows 5 s), the connection given up 5 s later (loadgen: 6
	// s). So grpc-go's balancer keeps sending a frozen member its share of requests
	// for 10-15 s; loadgen leaves a member at its first timeout.
	return clientv3.Config{Endpoints: e, DialTimeout: 5 * time.Second,
		DialKeepAliveTime: 10 * time.Second, DialKeepAliveTimeout: 5 * time.Second}
}

// reasons counts failed requests (profile: reads; failover: writes) by gRPC code or
// error text.
var (
	reasonsMu sync.Mutex
	reasons   = map[string]int64{}
)

func why(err error) {
	k := codeOf(err)
	reasonsMu.Lock()
	reasons[k]++
	reasonsMu.Unlock()
}

// codeOf is err's gRPC code, or its text if it has none.
func codeOf(err error) string {
	if st, ok := status.FromError(err); ok {
		return st.Code().String()
	}
	if err == context.DeadlineExceeded {
		return "deadline exceeded (client)"
	}
	return err.Error()
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd-profile:", err)
		os.Exit(1)
	}
}

func minI(a, b int) int {
	if a < b {
		return a
	}
	return b
}

func maxI(a, b int) int {
	if a > b {
		return a
	}
	return b
}
