# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The in-memory registry's AcquireRead hit path, compiled: one call that reads the request
(its serialized bytes, `hit_raw`, or its parsed fields, `hit`), checks it, matches the prompt's
hashes, pins the lease and returns the serialized AcquireReadResponse.

It is an optional speed-up of `LeaseTable.acquire_read` plus the servicer's reply, which stay
the reference: it does exactly what they do for a plain hit, on the same Python objects (the
table's dicts, `Pin`, the pin expiry wheel, the keyed pin ids), and returns None for
everything else before changing anything: a miss of any kind, input the checks would refuse,
a request written in a form `_parse` leaves to protobuf, a lapsed deadline that `tick()` has
not processed yet, a retried request id (whose pin may exist), a lease stored in another form.
The caller then takes the Python path, which answers those (errors included) as it always did.
`tests/test_fastread.py` runs both on random tables and requests and requires the same replies
and the same state.

Where it helps: the registry's p99 under load was the Python it ran per call (README,
"Registry"). A hit calls no Python function: 3.1 us in a tight loop, about 8 us at p50 in a
loaded server (cold caches); under the registry bench 165-181 us of server CPU per call against
212-219 for the Python path in the same runs (the echo: 149-165), p99 1.09-1.19x the echo's.
"""

from libc.math cimport ceil
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC, CLOCK_REALTIME

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE

import functools
import heapq
import time
from secrets import token_hex

from kvbridge import clock as _clock
from kvbridge.ids import PinIds
from kvbridge.services.registry._model import HolderState, LeaseState, Pin


cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    void* PyUnicode_DATA(object)
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    object PyUnicode_FromStringAndSize(const char*, Py_ssize_t)
    object PyLong_FromDouble(double)


cdef enum:
    HASH_SIZE = 16  # kvbridge.blockhash.HASH_SIZE (checked when a FastReader is made)
    ID_SIZE = 4     # a block id in a lease's payload: array("I"), uint32
    VARINT = 0      # protobuf wire types
    LEN = 2
    MAX_BOUNDS = 64  # histogram buckets the metrics may have


cdef inline bint _printable(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(n):
        if p[i] < 0x21 or p[i] > 0x7e:
            return 0
    return 1


cdef inline int _id_ok(str s, Py_ssize_t max_length):
    """`_validate.identifier` accepts it: 1..max_length printable ASCII, no spaces."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(s)
    if n == 0 or n > max_length or not PyUnicode_IS_ASCII(s):
        return 0
    return _printable(<const unsigned char*>PyUnicode_DATA(s), n)


cdef const char* _EMPTY = ""


cdef inline double _seconds(int clock_id) noexcept nogil:
    """As `time.clock_gettime(clock_id)` computes it."""
    cdef timespec ts
    clock_gettime(clock_id, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline double _seconds_of_ns(int clock_id) noexcept nogil:
    """As `time.time()` and `time.monotonic()` compute it (from nanoseconds)."""
    cdef timespec ts
    clock_gettime(clock_id, &ts)
    return <double>(<int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec) / 1e9
cdef inline Py_ssize_t _vsize(uint64_t v) noexcept nogil:
    cdef Py_ssize_t n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


cdef inline Py_ssize_t _tsize(int field) noexcept nogil:
    return 1 if field < 16 else 2


cdef inline Py_ssize_t _uint_size(int field, uint64_t v) noexcept nogil:
    """An implicit-presence scalar: nothing when zero."""
    return 0 if v == 0 else _tsize(field) + _vsize(v)


cdef inline Py_ssize_t _len_size(int field, Py_ssize_t n) noexcept nogil:
    """A length-delimited field that is always written (a present sub-message)."""
    return _tsize(field) + _vsize(<uint64_t>n) + n


cdef inline Py_ssize_t _str_size(int field, Py_ssize_t n) noexcept nogil:
    """A string or bytes field: nothing when empty."""
    return 0 if n == 0 else _len_size(field, n)


cdef inline char* _varint(char* p, uint64_t v) noexcept nogil:
    while v >= 0x80:
        p[0] = <char>((v & 0x7f) | 0x80)
        p += 1
        v >>= 7
    p[0] = <char>v
    return p + 1


cdef inline char* _tag(char* p, int field, int wire) noexcept nogil:
    return _varint(p, <uint64_t>((field << 3) | wire))


cdef inline char* _uint(char* p, int field, uint64_t v) noexcept nogil:
    if v == 0:
        return p
    return _varint(_tag(p, field, VARINT), v)


cdef inline char* _head(char* p, int field, Py_ssize_t n) noexcept nogil:
    return _varint(_tag(p, field, LEN), <uint64_t>n)


cdef inline char* _str(char* p, int field, const char* s, Py_ssize_t n) noexcept nogil:
    if n == 0:
        return p
    p = _head(p, field, n)
    memcpy(p, s, n)
    return p + n


cdef inline Py_ssize_t _time_size(int64_t seconds, int64_t nanos) noexcept nogil:
    """A google.protobuf.Duration or Timestamp's body (int64 seconds = 1, int32 nanos = 2;
    negative values as 10-byte two's complement varints, as protobuf writes them)."""
    return _uint_size(1, <uint64_t>seconds) + _uint_size(2, <uint64_t>nanos)


cdef inline char* _time(char* p, int field, int64_t seconds, int64_t nanos) noexcept nogil:
    p = _head(p, field, _time_size(seconds, nanos))
    p = _uint(p, 1, <uint64_t>seconds)
    return _uint(p, 2, <uint64_t>nanos)


cdef inline uint32_t _block_id(const char* ids, Py_ssize_t i) noexcept nogil:
    cdef uint32_t v = 0
    memcpy(&v, ids + i * ID_SIZE, ID_SIZE)
    return v


cdef inline const unsigned char* _read_varint(const unsigned char* p, const unsigned char* end,
                                              int max_bytes, uint64_t* out) noexcept nogil:
    """The varint at `p`, of at most `max_bytes` (<= 9) bytes: the byte after it; NULL when
    it is cut short or longer."""
    cdef uint64_t v = 0
    cdef int shift = 0, i
    for i in range(max_bytes):
        if p >= end:
            return NULL
        v |= <uint64_t>(p[0] & 0x7f) << shift
        if p[0] < 0x80:
            out[0] = v
            return p + 1
        p += 1
        shift += 7
    return NULL


cdef struct Request:
    const char* tenant
    Py_ssize_t tenant_len
    const char* conversation_id
    Py_ssize_t conversation_id_len
    const char* hashes
    Py_ssize_t hash_len
    uint64_t min_tokens
    uint64_t ttl_seconds
    uint64_t ttl_nanos
    const char* reader_id
    Py_ssize_t reader_id_len
    const char* request_id
    Py_ssize_t request_id_len


cdef bint _parse(const unsigned char* p, Py_ssize_t n, Request* r) noexcept nogil:
    """An AcquireReadRequest (registry.proto) in the plain form clients write: each field at
    most once, with its own wire type, no unknown fields, varints of the widths their values
    need at most, and a pin_ttl whose seconds and nanos are not negative. 0 for anything else:
    the caller leaves it to protobuf's parser (which may accept it, or refuse it) and the
    Python path."""
    cdef const unsigned char* end = p + n
    cdef const unsigned char* body
    cdef const unsigned char* q
    cdef unsigned seen = 0, seen_ttl = 0
    cdef int tag, field
    cdef uint64_t v
    # Absent fields read as empty, at a valid address (memcmp and memcpy of 0 bytes need one).
    r.tenant = r.conversation_id = r.hashes = r.reader_id = r.request_id = _EMPTY
    r.tenant_len = r.conversation_id_len = r.hash_len = r.reader_id_len = 0
    r.request_id_len = 0
    r.min_tokens = r.ttl_seconds = r.ttl_nanos = 0
    while p < end:
        tag = p[0]
        p += 1
        field = tag >> 3
        if tag & 0x80 or field < 1 or field > 7 or seen & (1u << field):
            return 0
        seen |= 1u << field
        if field == 4:  # uint32 min_tokens
            if tag & 7 != VARINT:
                return 0
            p = _read_varint(p, end, 5, &v)
            if p == NULL or v > 0xFFFFFFFFu:
                return 0
            r.min_tokens = v
            continue
        if tag & 7 != LEN:
            return 0
        p = _read_varint(p, end, 5, &v)
        if p == NULL or v > <uint64_t>(end - p):
            return 0
        body = p
        p += v
        if field == 1:
            r.tenant, r.tenant_len = <const char*>body, <Py_ssize_t>v
        elif field == 2:
            r.conversation_id, r.conversation_id_len = <const char*>body, <Py_ssize_t>v
        elif field == 3:
            r.hashes, r.hash_len = <const char*>body, <Py_ssize_t>v
        elif field == 6:
            r.reader_id, r.reader_id_len = <const char*>body, <Py_ssize_t>v
        elif field == 7:
            r.request_id, r.request_id_len = <const char*>body, <Py_ssize_t>v
        else:  # 5: google.protobuf.Duration pin_ttl (int64 seconds = 1, int32 nanos = 2)
            q = body
            while q < p:
                tag = q[0]
                q += 1
                if tag == 0x08 and not seen_ttl & 1:
                    seen_ttl |= 1
                    q = _read_varint(q, p, 9, &r.ttl_seconds)  # 9 bytes: below 2**63
                elif tag == 0x10 and not seen_ttl & 2:
                    seen_ttl |= 2
                    q = _read_varint(q, p, 5, &r.ttl_nanos)
                    if q != NULL and r.ttl_nanos > 0x7FFFFFFFu:  # negative as an int32
                        return 0
                else:
                    return 0
                if q == NULL:
                    return 0
    return 1


cdef class FastReader:
    """The hit path of one `LeaseTable` (made by `LeaseTable.fast_reader`).

    It works on the table's own objects: its dicts, `Pin` (made without running its
    `__init__`: the three slots are set here), the pin expiry wheel (a `pin_expiry.add`,
    inlined when the wheel is an `ExpiryWheel`), the keyed pin ids (`kvbridge.ids.PinIds`),
    and the table's clock (read in C when it is the `SystemClock`)."""

    cdef object _conversations, _pins, _pin_id, _pin_keyed, _monotonic, _wall
    cdef object _wheel, _wheel_buckets, _wheel_order, _add_expiry, _heappush
    cdef object _active_lease, _active_holder
    cdef object _hit_counts, _hit_key, _series, _series_counts
    cdef double _granularity
    cdef int _monotonic_id, _wall_id  # clock_gettime clocks; -1: call the Python clock
    cdef bint _monotonic_of_ns  # read as time.monotonic() reads (not time.clock_gettime())
    cdef bint _metrics
    cdef double _bounds[MAX_BOUNDS]
    cdef int _n_bounds
    cdef Py_ssize_t _max_id, _max_hashes
    cdef double _default_pin_ttl, _max_pin_ttl

    def __init__(self, table, int hash_size):
        from kvbridge.services.registry._expiry import ExpiryWheel

        if hash_size != HASH_SIZE:
            raise ValueError(f"compiled for {HASH_SIZE}-byte block hashes, not {hash_size}")
        cfg = table.config
        self._conversations = table._conversations
        self._pins = table._pins
        self._pin_id = table._pin_id
        self._pin_keyed = table._pin_id.keyed if type(table._pin_id) is PinIds else None
        wheel = table._pin_expiry
        self._add_expiry = wheel.add
        self._wheel = wheel if type(wheel) is ExpiryWheel else None
        if self._wheel is not None:
            self._wheel_buckets = wheel._buckets
            self._wheel_order = wheel._order
            self._granularity = wheel._granularity
        self._heappush = heapq.heappush
        clock = table.clock
        self._monotonic = clock.monotonic
        self._wall = clock.wall
        self._monotonic_id = self._wall_id = -1
        self._monotonic_of_ns = False
        if type(clock) is _clock.SystemClock:
            mono = _clock.monotonic
            if isinstance(mono, functools.partial) and mono.func is time.clock_gettime \
                    and len(mono.args) == 1 and not mono.keywords:
                self._monotonic_id = mono.args[0]
            elif mono is time.monotonic:
                self._monotonic_id = CLOCK_MONOTONIC
                self._monotonic_of_ns = True
            self._wall_id = CLOCK_REALTIME
        self._active_lease = LeaseState.ACTIVE
        self._active_holder = HolderState.ACTIVE
        self._max_id = cfg.max_id_length
        self._max_hashes = <Py_ssize_t>cfg.max_blocks_per_lease * 4 * HASH_SIZE
        self._default_pin_ttl = cfg.default_pin_ttl_s
        self._max_pin_ttl = cfg.max_pin_ttl_s
        self._metrics = False

    def attach_metrics(self, dict counts not None, str key not None, series not None):
        """Count each hit as `counts[key] += 1` and time it into `series` (a
        `_metrics._HistogramSeries`: its `counts` list per bucket of `bounds`, and `sum`), as
        the servicer does for the reads it answers."""
        bounds = tuple(series.bounds)
        if not 0 < len(bounds) <= MAX_BOUNDS or len(series.counts) != len(bounds):
            raise ValueError(f"a histogram of 1..{MAX_BOUNDS} buckets is needed")
        if key not in counts:
            raise ValueError(f"no count named {key!r}")
        for i, bound in enumerate(bounds):
            self._bounds[i] = bound
        self._n_bounds = len(bounds)
        self._hit_counts, self._hit_key = counts, key
        self._series, self._series_counts = series, series.counts
        self._metrics = True

    def hit(self, str tenant not None, str conversation_id not None, bytes hashes not None,
            long long min_tokens, double pin_ttl, str reader_id not None,
            str request_id not None):
        """The serialized AcquireReadResponse of a hit, the read pinned; None (nothing
        changed) for anything else. The arguments are `LeaseTable.acquire_read`'s."""
        cdef double start = _seconds(CLOCK_MONOTONIC) if self._metrics else 0.0
        cdef Py_ssize_t max_id = self._max_id
        cdef Py_ssize_t reader_len = 0, request_len = 0
        # The checks of `check_read` and `check_prompt_hashes`: input they refuse goes to them.
        if not (_id_ok(tenant, max_id) and _id_ok(conversation_id, max_id)):
            return None
        if PyUnicode_GET_LENGTH(reader_id) and not _id_ok(reader_id, max_id):
            return None
        if PyUnicode_GET_LENGTH(request_id) and not _id_ok(request_id, max_id):
            return None
        if not 0 <= min_tokens <= 2**31 or not pin_ttl >= 0:
            return None
        cdef const char* reader = PyUnicode_AsUTF8AndSize(reader_id, &reader_len)
        cdef const char* request = PyUnicode_AsUTF8AndSize(request_id, &request_len)
        return self._hit(tenant, conversation_id, PyBytes_AS_STRING(hashes),
                         PyBytes_GET_SIZE(hashes), min_tokens, pin_ttl, reader, reader_len,
                         request, request_len, start)

    def hit_raw(self, bytes raw not None, may_tenant=None):
        """`hit` of a serialized AcquireReadRequest, read here: None (nothing changed) for
        anything but a hit, for requests in a form `_parse` leaves to protobuf, and, given
        `may_tenant` (the caller's access rule, `kvbridge.auth.Rule.tenant_gate`), for a
        tenant it refuses (the Python path then refuses the call)."""
        cdef double start = _seconds(CLOCK_MONOTONIC) if self._metrics else 0.0
        cdef Request r
        if not _parse(<const unsigned char*>PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), &r):
            return None
        cdef Py_ssize_t max_id = self._max_id
        if not (0 < r.tenant_len <= max_id and 0 < r.conversation_id_len <= max_id
                and r.reader_id_len <= max_id and r.request_id_len <= max_id):
            return None
        if not (_printable(<const unsigned char*>r.tenant, r.tenant_len)
                and _printable(<const unsigned char*>r.conversation_id, r.conversation_id_len)
                and _printable(<const unsigned char*>r.reader_id, r.reader_id_len)
                and _printable(<const unsigned char*>r.request_id, r.request_id_len)):
            return None
        if r.min_tokens > 2**31:
            return None
        # As the servicer reads a Duration (`_seconds`).
        cdef double pin_ttl = <double><int64_t>r.ttl_seconds + <double>r.ttl_nanos * 1e-9
        tenant = PyUnicode_FromStringAndSize(r.tenant, r.tenant_len)
        if may_tenant is not None and not may_tenant(tenant):
            return None
        return self._hit(tenant,
                         PyUnicode_FromStringAndSize(r.conversation_id, r.conversation_id_len),
                         r.hashes, r.hash_len, <long long>r.min_tokens, pin_ttl, r.reader_id,
                         r.reader_id_len, r.request_id, r.request_id_len, start)

    cdef inline double _now(self):
        if self._monotonic_id >= 0:
            if self._monotonic_of_ns:
                return _seconds_of_ns(self._monotonic_id)
            return _seconds(self._monotonic_id)
        return <double>self._monotonic()

    cdef inline double _wall_now(self):
        if self._wall_id >= 0:
            return _seconds_of_ns(self._wall_id)
        return <double>self._wall()

    cdef object _hit(self, str tenant, str conversation_id, const char* theirs,
                     Py_ssize_t hash_len, long long min_tokens, double pin_ttl,
                     const char* reader, Py_ssize_t reader_len, const char* request,
                     Py_ssize_t request_len, double start):
        """`hit` past the checks of the request's own fields (ids, min_tokens, pin_ttl)."""
        if hash_len % HASH_SIZE or hash_len > self._max_hashes:
            return None
        cdef double now = self._now()
        by_conversation = self._conversations.get(tenant)
        if by_conversation is None:
            return None
        lease = by_conversation.get(conversation_id)
        if lease is None:
            return None
        holder = lease.holder
        # Readable now (`LeaseTable._readable`, with the deadlines `_refresh` would apply).
        if lease.state is not self._active_lease or holder.state is not self._active_holder:
            return None
        cdef double lease_expire_at = lease.expire_at
        if lease_expire_at <= now or <double>holder.expire_at <= now:
            return None
        payload = lease.payload
        if type(payload) is not bytes:
            return None
        cdef int64_t block_size = holder.block_size
        cdef int64_t token_count = lease.token_count
        if block_size <= 0 or token_count <= 0:
            return None
        cdef Py_ssize_t blocks = PyBytes_GET_SIZE(payload) // (HASH_SIZE + ID_SIZE)
        cdef Py_ssize_t full = token_count // block_size
        cdef const char* ours = PyBytes_AS_STRING(payload)
        cdef Py_ssize_t n = min(hash_len // HASH_SIZE, full), k = 0
        if full > blocks:
            return None
        # `blockhash.matching_prefix`: the leading blocks whose hashes are equal.
        if memcmp(ours, theirs, n * HASH_SIZE) == 0:
            k = n
        else:
            while memcmp(ours + k * HASH_SIZE, theirs + k * HASH_SIZE, HASH_SIZE) == 0:
                k += 1
        cdef bint partial = k == full and token_count % block_size != 0
        cdef int64_t reusable = k * block_size + (token_count - full * block_size if partial else 0)
        if reusable == 0 or reusable < min_tokens:
            return None
        cdef Py_ssize_t listed = k + 1 if partial else k
        if listed > blocks:
            return None

        # `LeaseTable._pin`'s deadline; a retry's existing pin is left to the Python path.
        cdef double max_pin_ttl = self._max_pin_ttl
        cdef double ttl = pin_ttl if pin_ttl != 0 else self._default_pin_ttl
        cdef double max_expire_at = lease.max_expire_at
        cdef double deadline = min(now + min(ttl, max_pin_ttl), max_expire_at + max_pin_ttl)
        if deadline <= now:
            return None
        if request_len:
            pin_id = self._keyed_pin_id(lease.tenant, reader, reader_len, request, request_len)
            if pin_id in self._pins:
                return None
        else:
            pin_id = "p-" + token_hex(8)
        cdef double idle_ttl = lease.idle_ttl

        # The reply, as `RegistryServicer._read_response` builds it for a hit, made before
        # anything changes (everything that can raise is here): the pin counted in it.
        cdef double left = deadline - self._now()
        cdef double wall = self._wall_now() + left
        if left < 0:
            left = 0.0
        cdef int64_t left_s = <int64_t>left, wall_s = <int64_t>wall
        cdef int64_t left_ns = <int64_t>((left - left_s) * 1e9)
        cdef int64_t wall_ns = <int64_t>((wall - wall_s) * 1e9)
        cdef uint64_t pin_count = lease.pin_count
        reply = _encode(lease, holder, k, partial, token_count, block_size, blocks, ours,
                        pin_id, pin_count + 1, left_s, left_ns, wall_s, wall_ns)
        pin = Pin.__new__(Pin)
        pin.pin_id = pin_id
        pin.lease = lease
        pin.expire_at = deadline
        cdef object key

        # `LeaseTable._pin`, in its order.
        self._pins[pin_id] = pin
        lease.pin_count += 1
        if self._wheel is None:
            self._add_expiry(pin, deadline)
        else:  # ExpiryWheel.add
            key = PyLong_FromDouble(ceil(deadline / self._granularity))
            bucket = self._wheel_buckets.get(key)
            if bucket is None:
                self._wheel_buckets[key] = [pin]
                self._heappush(self._wheel_order, key)
            else:
                bucket.append(pin)
            self._wheel._size += 1
        lease.expire_at = min(now + idle_ttl, max_expire_at)
        if self._metrics:
            self._count(start)
        return reply

    cdef object _keyed_pin_id(self, str tenant, const char* reader, Py_ssize_t reader_len,
                              const char* request, Py_ssize_t request_len):
        """`PinIds(tenant, reader_id, request_id)`, from the keyed hash's state."""
        if self._pin_keyed is None:
            return self._pin_id(tenant, PyUnicode_FromStringAndSize(reader, reader_len),
                                PyUnicode_FromStringAndSize(request, request_len))
        cdef Py_ssize_t tenant_len = 0
        cdef const char* t = PyUnicode_AsUTF8AndSize(tenant, &tenant_len)
        cdef Py_ssize_t n = tenant_len + 1 + reader_len + 1 + request_len
        data = PyBytes_FromStringAndSize(NULL, n)
        cdef char* p = PyBytes_AS_STRING(data)
        memcpy(p, t, tenant_len)
        p[tenant_len] = 0
        memcpy(p + tenant_len + 1, reader, reader_len)
        p[tenant_len + 1 + reader_len] = 0
        memcpy(p + tenant_len + 2 + reader_len, request, request_len)
        h = self._pin_keyed.copy()
        h.update(data)
        return "p-" + h.hexdigest()

    cdef void _count(self, double start) except *:
        """A hit, counted and timed (`_HistogramSeries.observe`: the first bound >= it)."""
        cdef double took = _seconds(CLOCK_MONOTONIC) - start
        cdef int i = 0
        while i < self._n_bounds - 1 and self._bounds[i] < took:
            i += 1
        self._hit_counts[self._hit_key] += 1
        self._series_counts[i] += 1
        self._series.sum += took


cdef bytes _encode(lease, holder, Py_ssize_t k, bint partial, int64_t token_count,
                   int64_t block_size, Py_ssize_t blocks, const char* payload, str pin_id,
                   uint64_t pin_count, int64_t left_s, int64_t left_ns, int64_t wall_s,
                   int64_t wall_ns):
    """AcquireReadResponse (registry.proto) of a hit: fields in number order, zero scalars
    left out, present sub-messages always written (as upb does)."""
    cdef Py_ssize_t n_lease_id = 0, n_tenant = 0, n_conv = 0, n_holder_id = 0, n_remote = 0
    cdef Py_ssize_t n_host = 0, n_fp = 0, n_pin = 0
    cdef const char* lease_id = PyUnicode_AsUTF8AndSize(lease.lease_id, &n_lease_id)
    cdef const char* tenant = PyUnicode_AsUTF8AndSize(lease.tenant, &n_tenant)
    cdef const char* conv = PyUnicode_AsUTF8AndSize(lease.conversation_id, &n_conv)
    cdef const char* holder_id = PyUnicode_AsUTF8AndSize(holder.holder_id, &n_holder_id)
    cdef const char* remote = PyUnicode_AsUTF8AndSize(lease.remote_request_id, &n_remote)
    cdef const char* host = PyUnicode_AsUTF8AndSize(holder.nixl_host, &n_host)
    cdef const char* fp = PyUnicode_AsUTF8AndSize(holder.fingerprint, &n_fp)
    cdef const char* pin = PyUnicode_AsUTF8AndSize(pin_id, &n_pin)
    cdef uint64_t epoch = lease.epoch
    cdef uint64_t port = holder.nixl_port, tp_size = holder.tp_size
    cdef const char* ids = payload + blocks * HASH_SIZE
    cdef Py_ssize_t i, ids_len = 0, lease_len, holder_len, pin_len, total
    for i in range(k):
        ids_len += _vsize(_block_id(ids, i))
    lease_len = (_str_size(1, n_lease_id) + _str_size(2, n_tenant) + _str_size(3, n_conv)
                 + _str_size(4, n_holder_id) + _str_size(5, n_remote)
                 + _uint_size(7, <uint64_t>token_count) + _uint_size(9, epoch)
                 + _uint_size(10, 1) + _uint_size(16, pin_count))
    holder_len = (_str_size(1, n_holder_id) + _str_size(2, n_host) + _uint_size(3, port)
                  + _uint_size(4, tp_size) + _uint_size(5, <uint64_t>block_size)
                  + _str_size(6, n_fp) + _uint_size(7, 1))
    pin_len = (_str_size(1, n_pin) + _len_size(2, _time_size(left_s, left_ns))
               + _len_size(3, _time_size(wall_s, wall_ns)))
    cdef uint64_t partial_id = _block_id(ids, k) if partial else 0
    cdef uint64_t partial_tokens = token_count - k * block_size if partial else 0
    total = (_uint_size(2, k) + _len_size(3, lease_len) + _len_size(4, holder_len)
             + _uint_size(5, k) + _uint_size(6, <uint64_t>(k * block_size))
             + _str_size(7, ids_len) + _uint_size(8, partial_id)
             + _uint_size(9, partial_tokens) + (_len_size(10, HASH_SIZE) if partial else 0)
             + _len_size(11, pin_len))
    cdef char* buf = <char*>malloc(total)
    if buf == NULL:
        raise MemoryError()
    cdef char* p = buf
    try:
        p = _uint(p, 2, k)  # mismatch_block: every compared block matched
        p = _head(p, 3, lease_len)
        p = _str(p, 1, lease_id, n_lease_id)
        p = _str(p, 2, tenant, n_tenant)
        p = _str(p, 3, conv, n_conv)
        p = _str(p, 4, holder_id, n_holder_id)
        p = _str(p, 5, remote, n_remote)
        p = _uint(p, 7, <uint64_t>token_count)
        p = _uint(p, 9, epoch)
        p = _uint(p, 10, 1)  # LEASE_STATE_ACTIVE
        p = _uint(p, 16, pin_count)
        p = _head(p, 4, holder_len)
        p = _str(p, 1, holder_id, n_holder_id)
        p = _str(p, 2, host, n_host)
        p = _uint(p, 3, port)
        p = _uint(p, 4, tp_size)
        p = _uint(p, 5, <uint64_t>block_size)
        p = _str(p, 6, fp, n_fp)
        p = _uint(p, 7, 1)  # HOLDER_STATE_ACTIVE
        p = _uint(p, 5, k)
        p = _uint(p, 6, <uint64_t>(k * block_size))
        if ids_len:
            p = _head(p, 7, ids_len)
            for i in range(k):
                p = _varint(p, _block_id(ids, i))
        p = _uint(p, 8, partial_id)
        p = _uint(p, 9, partial_tokens)
        if partial:
            p = _str(p, 10, payload + k * HASH_SIZE, HASH_SIZE)
        p = _head(p, 11, pin_len)
        p = _str(p, 1, pin, n_pin)
        p = _time(p, 2, left_s, left_ns)
        p = _time(p, 3, wall_s, wall_ns)
        if p - buf != total:
            raise AssertionError(f"AcquireReadResponse: wrote {p - buf} of {total} bytes")
        return PyBytes_FromStringAndSize(buf, total)
    finally:
        free(buf)
