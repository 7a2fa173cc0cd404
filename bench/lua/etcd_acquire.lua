-- The peer: an acquire on etcd 3.4 through its JSON gateway is a lease grant
-- (POST /v3/lease/grant) followed by a put-if-absent transaction on a fresh key
-- bound to that lease (POST /v3/kv/txn, compare create_revision == 0). Two HTTP
-- requests per acquire; "acquired" counts transactions that succeeded.
dofile(debug.getinfo(1, "S").source:match("^@(.*/)") .. "common.lua")

local n, lease = 0, nil
local value = base64("held")

function init(args)
   common_init(args)
end

function request()
   if not lease then
      return post("/v3/lease/grant", '{"TTL":60}')
   end
   n = n + 1
   local key = base64("/leasekeeper-bench/" .. RUN .. "/" .. id .. "/" .. n)
   return post("/v3/kv/txn",
      '{"compare":[{"target":"CREATE","result":"EQUAL","key":"' .. key .. '","create_revision":"0"}],' ..
      '"success":[{"request_put":{"key":"' .. key .. '","value":"' .. value .. '","lease":"' .. lease .. '"}}],' ..
      '"failure":[{"request_range":{"key":"' .. key .. '"}}]}')
end

function response(status, headers, body)
   tally(status)
   if not lease then
      lease = status == 200 and body:match('"ID":"(%d+)"') or nil
   else
      if status == 200 and body:find('"succeeded":true', 1, true) then
         tally("acquired")
      end
      lease = nil
   end
end
