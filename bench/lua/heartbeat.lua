-- Heartbeats: many holders renew their leases. Argument 3 is a file of
-- "key owner_token" lines (leases acquired by the driver beforehand, in the
-- namespace of argument 2); argument 4 the number of threads. Thread i renews
-- lines i, i + threads, ... round-robin.
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local holders, next_holder = {}, 1

function init(args)
   common_init(args)
   local threads = tonumber(args[4])
   local line_no = 0
   for line in io.lines(args[3]) do
      if line_no % threads == id then
         local key, token = line:match("^(%S+) (%S+)$")
         table.insert(holders, lease_body(key, ',"owner_token":"' .. token .. '","ttl_seconds":600'))
      end
      line_no = line_no + 1
   end
end

function request()
   local body = holders[next_holder]
   next_holder = next_holder % #holders + 1
   return post("/services/v1/lease/renew", body)
end

function response(status, headers, body)
   tally(status)
end
