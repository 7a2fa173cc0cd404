-- Shared by every benchmark script (loaded with dofile from the script's own folder).
--
-- The driver runs wrk with as many threads as connections, so each thread's Lua
-- state drives exactly one connection: request() and response() strictly
-- alternate, and a script can keep a multi-step flow (acquire, then complete
-- with the returned owner token, ...) in plain local variables.
--
-- Arguments after `--`: a run tag, a namespace, then script-specific values.
-- Every script calls tally(status) in response(); done() prints one line
-- "BENCH_JSON {...}" with wrk's summary, latency percentiles, the merged
-- per-thread counters and latency quantiles, which the driver parses.

local threads = {}

function setup(thread)
   thread:set("id", #threads)
   table.insert(threads, thread)
end

counters = {}  -- per thread: HTTP status codes and named events

function tally(name)
   counters[name] = (counters[name] or 0) + 1
end

HEADERS = { ["Content-Type"] = "application/json" }

function post(path, body)
   return wrk.format("POST", path, HEADERS, body)
end

function common_init(args)
   RUN = args[1]
   NS = args[2]
   math.randomseed(id * 7919 + os.time())
end

-- A lease body; extra is already-encoded JSON members, starting with a comma.
function lease_body(key, extra)
   return '{"namespace":"' .. NS .. '","key":"' .. key .. '"' .. (extra or "") .. "}"
end

function owner_token(body)
   return body:match('"owner_token":"([^"]+)"')
end

local b64chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

function base64(data)
   return ((data:gsub(".", function(x)
      local r, b = "", x:byte()
      for i = 8, 1, -1 do r = r .. (b % 2 ^ i - b % 2 ^ (i - 1) > 0 and "1" or "0") end
      return r
   end) .. "0000"):gsub("%d%d%d?%d?%d?%d?", function(x)
      if #x < 6 then return "" end
      local c = 0
      for i = 1, 6 do c = c + (x:sub(i, i) == "1" and 2 ^ (6 - i) or 0) end
      return b64chars:sub(c + 1, c + 1)
   end) .. ({ "", "==", "=" })[#data % 3 + 1])
end

-- The latency at percentiles 0.5, 1, ..., 99, 99.01, ..., 99.99 and 100, as
-- "[percentile,us],...": enough of each run's distribution for the driver to
-- merge runs (the cleanup's p99 is taken over all of its windows together).
-- wrk 4.1 would give its whole histogram too (latency(i): the i-th distinct
-- value and its count), but that is some 10,000 pairs a run, for every window.
function quantiles(latency)
   local parts = {}
   local function add(p)
      table.insert(parts, string.format("[%g,%d]", p, latency:percentile(p)))
   end
   for i = 1, 198 do add(i / 2) end
   for i = 9901, 9999 do add(i / 100) end
   -- percentile(100) is 0 in wrk 4.1 (its rank is past the last request)
   table.insert(parts, string.format("[100,%d]", latency.max))
   return table.concat(parts, ",")
end

-- How many samples wrk's latency histogram holds: more than the requests, since
-- wrk corrects it for coordinated omission (a request that took more than twice
-- the mean time between one connection's requests adds samples for those the
-- stalled connection did not send). Its percentiles are over these samples.
function samples(latency)
   local total = 0
   for i = 1, #latency do
      local _, count = latency(i)
      total = total + count
   end
   return total
end

function done(summary, latency, requests)
   local merged = {}
   for _, thread in ipairs(threads) do
      for name, count in pairs(thread:get("counters")) do
         local key = tostring(name)
         merged[key] = (merged[key] or 0) + count
      end
   end
   local parts = {}
   for name, count in pairs(merged) do
      table.insert(parts, string.format('"%s":%d', name, count))
   end
   local e = summary.errors
   io.write(string.format(
      'BENCH_JSON {"requests":%d,"samples":%d,"duration_us":%d,"bytes":%d,' ..
      '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
      '"latency_us":{"min":%d,"mean":%.1f,"p50":%d,"p90":%d,"p99":%d,"p999":%d,"max":%d},' ..
      '"counters":{%s},"quantiles":[%s]}\n',
      summary.requests, samples(latency), summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency.min, latency.mean, latency:percentile(50), latency:percentile(90),
      latency:percentile(99), latency:percentile(99.9), latency.max,
      table.concat(parts, ","), quantiles(latency)))
end
